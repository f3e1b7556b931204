#!/usr/bin/env python3
"""Fault-injection harness of the distributed broker (issue 14).

Each run starts a throwaway PostgreSQL cluster and a throwaway nats-server (other ports, a
temporary directory), aip-registry, aip-sessions (two replicas for the frozen-leader fault)
and two aip-gateway processes, puts closed-loop load on gateway A (devices and Galaxy-format
constellations running two-step scripted tasks), injects one fault, lets the broker settle,
then checks: every task got a task_end, nothing non-terminal in the database, no command run
twice, every event log gap-free, fresh tasks complete on both gateways and over REST, every
/readyz. It only ever signals processes it started itself, and never touches the machine's
own NATS (4222) or PostgreSQL (5432).

Usage: bench/faults/run.sh [--scale small|full] [--faults none,sessions-kill,...] [--keep]
Environment: FAULTS_RUST_LOG, the services' RUST_LOG (default info; e.g.
info,aip_sessions=debug to follow a lost frame in the logs kept under --results).
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PG_BIN = "/usr/lib/postgresql/15/bin"
NATS_SERVER = "/usr/sbin/nats-server"
TERMINAL = ("completed", "failed", "canceled", "rejected")
PREFIX = "faults"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Scales: devices, constellations, load seconds, fault at, settle seconds; `small` also
# shortens the registry's liveness window so a dead gateway's agents expire within its
# settle period, yet stays above the ~4 s a NATS restart takes (the full scale keeps every
# default, as an operator would run it).
SCALES = {
    "full": dict(devices=20, constellations=20, load=40, fault_at=10, settle=40, env={}),
    "small": dict(devices=4, constellations=4, load=8, fault_at=3, settle=10,
                  env={"AIP_REGISTRY__LIVENESS_MS": "6000"}),
}
FAULTS = ["none", "sessions-kill", "postgres-stop", "gateway-kill", "gateway-kill-new-id",
          "nats-kill", "registry-kill", "sessions-sigstop", "partition", "disk-full",
          "db-connections"]
# How long fresh tasks have to complete after settling.
AFTERWARDS_SECS = {"full": 30, "small": 15}
# How long the frozen session leader stays frozen: longer than any lease or redelivery timer.
FREEZE_SECS = {"full": 15, "small": 6}
# How long the gateway stays cut off from NATS in the partition fault.
PARTITION_SECS = {"full": 15, "small": 6}
# How long PostgreSQL's disk stays full, and its connections taken, in those faults.
DB_FAULT_SECS = {"full": 10, "small": 5}
# The size of the filesystem PostgreSQL's data directory lives on in the disk-full fault.
PG_DISK = "1g"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg):
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def http_status(url, timeout=2.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def http_json(method, url, body=None, timeout=5.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]
    except OSError as e:
        return None, repr(e)


class Proc:
    """A process the harness started (and so may signal)."""

    def __init__(self, name, argv, env, logfile, netns=None):
        self.name, self.argv, self.env, self.logfile, self.netns = name, argv, env, logfile, netns
        self.popen = None

    def start(self):
        argv = self.argv
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns] + argv
        out = open(self.logfile, "ab")
        self.popen = subprocess.Popen(argv, env={**os.environ, **self.env}, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    @property
    def pid(self):
        return self.popen.pid if self.popen else None

    def alive(self):
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.popen.pid, sig)

    def stop(self, grace=5.0):
        if not self.alive():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait()


class Cluster:
    """The throwaway NATS, PostgreSQL and broker processes of one run."""

    def __init__(self, fault, scale, workdir):
        self.fault, self.scale = fault, scale
        self.dir = workdir
        self.logs = os.path.join(workdir, "logs")
        os.makedirs(self.logs)
        self.pg_dir = os.path.join(workdir, "pg")
        self.pg_port = free_port()
        self.nats_port = free_port()
        self.nats_host = "127.0.0.1"
        self.procs = {}
        self.pg_mounted = False
        self.hogs = []
        self.netns = None
        self.gw_host = {"a": "127.0.0.1", "b": "127.0.0.1"}

    # --- PostgreSQL -------------------------------------------------------------------
    def pg_ctl(self, *args, check=True):
        return subprocess.run(["runuser", "-u", "postgres", "--", f"{PG_BIN}/pg_ctl", "-D", self.pg_dir,
                               *args], check=check, capture_output=True, text=True)

    def pg_start(self):
        self.pg_ctl("-o", f"-p {self.pg_port} -k {self.pg_dir} -c listen_addresses=''",
                    "-l", os.path.join(self.logs, "postgres.log"), "-w", "start")

    def psql(self, sql, db="aip"):
        r = subprocess.run(["psql", "-h", self.pg_dir, "-p", str(self.pg_port), "-U", "postgres",
                            "-d", db, "-At", "-F", "\t", "-c", sql],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"psql: {r.stderr.strip()}")
        return [line.split("\t") for line in r.stdout.splitlines() if line]

    def start_infra(self):
        os.chmod(self.dir, 0o755)
        os.makedirs(self.pg_dir)
        if self.fault == "disk-full":
            # A filesystem of its own, which the fault fills up.
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={PG_DISK},mode=0700", "tmpfs",
                            self.pg_dir], check=True, capture_output=True)
            self.pg_mounted = True
        shutil.chown(self.pg_dir, "postgres", "postgres")
        shutil.chown(self.logs, "postgres", "postgres")
        os.chmod(self.logs, 0o777)
        subprocess.run(["runuser", "-u", "postgres", "--", f"{PG_BIN}/initdb", "-D", self.pg_dir,
                        "-A", "trust", "-U", "postgres"], check=True, capture_output=True)
        self.pg_start()
        self.psql("CREATE DATABASE aip", db="postgres")
        if self.fault == "partition":
            self.setup_netns()
        nats_dir = os.path.join(self.dir, "nats")
        self.procs["nats"] = Proc("nats", [NATS_SERVER, "-a", self.nats_host, "-p", str(self.nats_port),
                                           "-js", "-sd", nats_dir], {},
                                  os.path.join(self.logs, "nats.log"))
        self.procs["nats"].start()
        wait_port(self.nats_host, self.nats_port, "nats-server")

    # --- network namespace (partition fault) --------------------------------------------
    def setup_netns(self):
        """Gateway A runs in a namespace of its own behind a veth pair, so its link to NATS
        can be cut (a DROP rule on the NATS port inside the namespace) while its clients
        still reach it."""
        suffix = str(os.getpid() % 100000)
        self.netns = f"aipf{suffix}"
        host_if, ns_if = f"aipfh{suffix}", f"aipfn{suffix}"
        net = 10 + os.getpid() % 200
        # .1 the host end (clients' source), .2 gateway A, .3 NATS (a second host address,
        # so that cutting it leaves the clients' traffic alone)
        self.host_ip, self.ns_ip, self.nats_ip = f"10.{net}.77.1", f"10.{net}.77.2", f"10.{net}.77.3"
        cmds = [
            ["ip", "netns", "add", self.netns],
            ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
            ["ip", "link", "set", ns_if, "netns", self.netns],
            ["ip", "addr", "add", f"{self.host_ip}/24", "dev", host_if],
            ["ip", "addr", "add", f"{self.nats_ip}/24", "dev", host_if],
            ["ip", "link", "set", host_if, "up"],
            ["ip", "netns", "exec", self.netns, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", ns_if],
            ["ip", "netns", "exec", self.netns, "ip", "link", "set", ns_if, "up"],
            ["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"],
        ]
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True)
        self.host_if, self.ns_if = host_if, ns_if
        # NATS must be reachable from the namespace: it listens on the host end of the veth
        # (and the other services reach it there too).
        self.nats_host = self.nats_ip
        self.gw_host["a"] = self.ns_ip

    def partition(self, cut):
        """Cuts (or heals) gateway A's link to NATS only: its clients keep their sockets."""
        action = "add" if cut else "del"
        # `ip route` blackhole of the NATS address inside the namespace: no iptables here.
        subprocess.run(["ip", "netns", "exec", self.netns, "ip", "route", action, "blackhole",
                        f"{self.nats_ip}/32"], check=True, capture_output=True)

    # --- database faults ---------------------------------------------------------------
    def fill_disk(self):
        """Fills the filesystem of PostgreSQL's data directory: its next WAL write fails."""
        filler = os.path.join(self.pg_dir, "filler")
        free = shutil.disk_usage(self.pg_dir).free
        subprocess.run(["fallocate", "-l", str(free), filler], capture_output=True)
        # What fallocate left (tmpfs rounds to pages) goes too.
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k", "oflag=append",
                        "conv=notrunc", "status=none"], capture_output=True)
        return shutil.disk_usage(self.pg_dir).free

    def free_disk(self):
        """Frees the space again, and starts PostgreSQL if the full disk stopped it."""
        os.remove(os.path.join(self.pg_dir, "filler"))
        running = self.pg_ctl("status", check=False).returncode == 0
        if not running:
            self.pg_start()
        return running

    def take_connections(self, secs):
        """Opens connections until PostgreSQL refuses more (superuser slots included), each
        holding its slot for `secs`; returns how many it holds."""
        for _ in range(400):
            hog = subprocess.Popen(["psql", "-h", self.pg_dir, "-p", str(self.pg_port), "-U", "postgres",
                                    "-d", "postgres", "-Atc", f"SELECT pg_sleep({secs})"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(0.05)
            if hog.poll() is not None:
                break
            self.hogs.append(hog)
        return len(self.hogs)

    def release_connections(self):
        for hog in self.hogs:
            hog.terminate()
        for hog in self.hogs:
            hog.wait()
        self.hogs = []

    def teardown_netns(self):
        if self.netns:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)

    # --- broker ------------------------------------------------------------------------
    def common_env(self):
        return {
            "AIP_NATS_URL": f"nats://{self.nats_host}:{self.nats_port}",
            "AIP_DATABASE_URL": f"postgres://postgres@localhost:{self.pg_port}/aip?host={self.pg_dir}",
            "AIP_SUBJECT_PREFIX": PREFIX,
            "RUST_LOG": os.environ.get("FAULTS_RUST_LOG", "info"),
            **SCALES[self.scale]["env"],
        }

    def bin(self, name):
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
        return os.path.join(target, "debug", name)

    def start_broker(self):
        env = self.common_env()
        self.registry_port = free_port()
        self.add("registry", "aip-registry", {**env, "AIP_REGISTRY__LISTEN": f"127.0.0.1:{self.registry_port}",
                                              "AIP_REGISTRY__SHUTDOWN_GRACE_MS": "2000"})
        self.wait_ready("registry", f"http://127.0.0.1:{self.registry_port}/readyz")
        self.sessions_ports = {}
        replicas = 2 if self.fault == "sessions-sigstop" else 1
        for i in range(1, replicas + 1):
            port = free_port()
            self.sessions_ports[f"sessions{i}"] = port
            self.add(f"sessions{i}", "aip-sessions", {**env, "AIP_SESSIONS__LISTEN": f"127.0.0.1:{port}",
                                                      "AIP_SESSIONS__SHUTDOWN_GRACE_MS": "2000"})
            if i == 1:
                self.wait_ready("sessions1", f"http://127.0.0.1:{port}/readyz")
        self.gw_ports = {}
        for g in ("a", "b"):
            port = free_port()
            self.gw_ports[g] = port
            host = self.gw_host[g]
            self.add(f"gateway-{g}", "aip-gateway",
                     {**env, "AIP_GATEWAY__LISTEN": f"{host}:{port}", "AIP_GATEWAY__GATEWAY_ID": f"gw-{g}",
                      "AIP_GATEWAY__ALLOW_NO_AUTH": "true", "AIP_GATEWAY__FRAMES_PER_SECOND": "0",
                      "AIP_GATEWAY__SHUTDOWN_GRACE_MS": "2000"},
                     netns=self.netns if g == "a" else None)
            self.wait_ready(f"gateway-{g}", f"http://{host}:{port}/readyz")

    def add(self, name, binary, env, netns=None):
        proc = Proc(name, [self.bin(binary)], env, os.path.join(self.logs, f"{name}.log"), netns)
        self.procs[name] = proc
        proc.start()

    def wait_ready(self, name, url, secs=30):
        end = time.monotonic() + secs
        while time.monotonic() < end:
            if http_status(url) == 200:
                return
            if not self.procs[name].alive():
                raise RuntimeError(f"{name} exited; see {self.procs[name].logfile}")
            time.sleep(0.2)
        raise RuntimeError(f"{name} not ready within {secs}s; see {self.procs[name].logfile}")

    def ws_url(self, g):
        return f"ws://{self.gw_host[g]}:{self.gw_ports[g]}/ws"

    def readyz(self):
        urls = {"registry": f"http://127.0.0.1:{self.registry_port}/readyz"}
        for name, port in self.sessions_ports.items():
            urls[name] = f"http://127.0.0.1:{port}/readyz"
        for g, port in self.gw_ports.items():
            urls[f"gateway-{g}"] = f"http://{self.gw_host[g]}:{port}/readyz"
        return {name: http_status(url) for name, url in urls.items()}

    def sessions_leader(self):
        for name, port in self.sessions_ports.items():
            if http_status(f"http://127.0.0.1:{port}/readyz") == 200:
                return name
        return None

    def rest_url(self):
        leader = self.sessions_leader() or "sessions1"
        return f"http://127.0.0.1:{self.sessions_ports[leader]}"

    def teardown(self):
        for name in list(self.procs):
            if name != "nats":
                self.procs[name].stop()
        if "nats" in self.procs:
            self.procs["nats"].stop()
        self.release_connections()
        if os.path.exists(os.path.join(self.pg_dir, "postmaster.pid")):
            self.pg_ctl("-m", "fast", "stop", check=False)
        if self.pg_mounted:
            subprocess.run(["umount", "-l", self.pg_dir], capture_output=True)
        self.teardown_netns()


def wait_port(host, port, name, secs=15):
    end = time.monotonic() + secs
    while time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{name} not listening on {host}:{port}")


# --- faults ---------------------------------------------------------------------------
async def inject(cluster, fault, scale, events):
    """Injects `fault`; appends (seconds, what) to `events` as it goes."""
    loop = asyncio.get_running_loop()

    def note(what):
        events.append((round(time.monotonic() - T0, 1), what))
        log(f"fault: {what}")

    async def kill_restart(name, pause):
        proc = cluster.procs[name]
        note(f"kill -9 {name} (pid {proc.pid})")
        proc.signal(signal.SIGKILL)
        await loop.run_in_executor(None, proc.popen.wait)
        await asyncio.sleep(pause)
        proc.start()
        note(f"{name} restarted (pid {proc.pid})")

    if fault == "none":
        return
    if fault == "sessions-kill":
        await kill_restart("sessions1", 2)
    elif fault == "registry-kill":
        await kill_restart("registry", 2)
    elif fault == "gateway-kill":
        # restarted with its configured id, as a fixed `gateway_id` (a unit file, a
        # StatefulSet) restarts
        await kill_restart("gateway-a", 0)
    elif fault == "gateway-kill-new-id":
        # restarted under a new id, as the default id (host name + random suffix) restarts
        cluster.procs["gateway-a"].env["AIP_GATEWAY__GATEWAY_ID"] = "gw-a2"
        await kill_restart("gateway-a", 0)
    elif fault == "nats-kill":
        await kill_restart("nats", 3)
    elif fault == "postgres-stop":
        note("PostgreSQL immediate stop")
        await loop.run_in_executor(None, lambda: cluster.pg_ctl("-m", "immediate", "stop"))
        await asyncio.sleep(3)
        await loop.run_in_executor(None, cluster.pg_start)
        note("PostgreSQL started")
    elif fault == "disk-full":
        left = await loop.run_in_executor(None, cluster.fill_disk)
        note(f"PostgreSQL's disk full ({left} bytes left)")
        await asyncio.sleep(DB_FAULT_SECS[scale])
        survived = await loop.run_in_executor(None, cluster.free_disk)
        note("disk space freed; PostgreSQL " + ("kept running" if survived else "had stopped: started again"))
    elif fault == "db-connections":
        held = await loop.run_in_executor(None, cluster.take_connections, DB_FAULT_SECS[scale] + 5)
        note(f"PostgreSQL's connections taken ({held} held; new connections refused)")
        await asyncio.sleep(DB_FAULT_SECS[scale])
        await loop.run_in_executor(None, cluster.release_connections)
        note("connections released")
    elif fault == "sessions-sigstop":
        leader = await loop.run_in_executor(None, cluster.sessions_leader)
        proc = cluster.procs[leader]
        note(f"SIGSTOP {leader} (the leader, pid {proc.pid})")
        proc.signal(signal.SIGSTOP)
        await asyncio.sleep(FREEZE_SECS[scale])
        note(f"standby's readyz while the leader is frozen: {await loop.run_in_executor(None, cluster.readyz)}")
        proc.signal(signal.SIGCONT)
        note(f"SIGCONT {leader}")
    elif fault == "partition":
        note("gateway A cut off from NATS (blackhole route in its namespace)")
        await loop.run_in_executor(None, cluster.partition, True)
        await asyncio.sleep(PARTITION_SECS[scale])
        await loop.run_in_executor(None, cluster.partition, False)
        note("gateway A's link to NATS healed")


# --- one run ----------------------------------------------------------------------------
T0 = 0.0


async def drive(cluster, fault, scale):
    """Load, fault, settle, checks; returns the run's figures."""
    global T0
    cfg = SCALES[scale]
    record = load.Record()
    stop = load.Stop()
    run_id = f"r{int(time.time())}"
    url_a = cluster.ws_url("a")
    clients = []
    readies = []
    for d in range(cfg["devices"]):
        ev = asyncio.Event()
        readies.append(ev)
        clients.append(asyncio.ensure_future(load.device(record, stop, url_a, f"dev{d}", time.monotonic(), ev)))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in readies)), 30)
    readies = []
    T0 = time.monotonic()  # the load starts with the first constellation
    for c in range(cfg["constellations"]):
        ev = asyncio.Event()
        readies.append(ev)
        d = c % cfg["devices"]
        clients.append(asyncio.ensure_future(
            load.constellation(record, stop, url_a, f"g{c}@dev{d}", f"dev{d}", run_id, T0, ready=ev)))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in readies)), 30)
    log(f"{fault}: load on gateway A for {cfg['load']}s, fault at {cfg['fault_at']}s")
    events = []
    await asyncio.sleep(cfg["fault_at"])
    fault_task = asyncio.ensure_future(inject(cluster, fault, scale, events))
    await asyncio.sleep(cfg["load"] - cfg["fault_at"])
    stop.submitting = False
    load_end = time.monotonic() - T0
    await fault_task
    log(f"{fault}: load over ({len(record.tasks)} tasks submitted); settling {cfg['settle']}s")
    await asyncio.sleep(cfg["settle"])
    loop = asyncio.get_running_loop()

    # The database after settling (clients still connected: a requester that hung up would
    # cancel its tasks and hide a stuck one).
    non_terminal = await loop.run_in_executor(None, cluster.psql,
        f"SELECT state, count(*) FROM tasks WHERE state NOT IN {TERMINAL} GROUP BY state")
    db_states = dict(await loop.run_in_executor(None, cluster.psql, "SELECT task_id, state FROM tasks"))
    gaps = await loop.run_in_executor(None, cluster.psql,
        "SELECT count(*) FROM (SELECT t.task_id, count(e.seq) AS n, min(e.seq) AS lo, max(e.seq) AS hi "
        "FROM tasks t LEFT JOIN task_events e ON e.task_id = t.task_id GROUP BY t.task_id) x "
        "WHERE n = 0 OR lo <> 1 OR hi <> n")
    readyz = await loop.run_in_executor(None, cluster.readyz)
    snapshot = {sid: (t.end_status, t.socket_lost, list(t.errors), t.end_error)
                for sid, t in record.tasks.items()}

    afterwards = await check_afterwards(cluster, cfg, run_id)
    stop.closing.set()
    await asyncio.gather(*clients, return_exceptions=True)
    twice_id, twice_step = record.twice()

    completed = [s for s in snapshot.values() if s[0] == "completed"]
    ended_other = {}
    for sid, s in snapshot.items():
        if s[0] not in (None, "completed"):
            key = f"{s[0]}: {(s[3] or '')[:90]}"
            ended_other[key] = ended_other.get(key, 0) + 1
    no_end = [sid for sid, s in snapshot.items() if s[0] is None]
    no_end_live = [sid for sid in no_end if not snapshot[sid][1]]
    no_end_lost = [sid for sid in no_end if snapshot[sid][1]]
    errors_only = {}
    for sid in no_end:
        for e in snapshot[sid][2]:
            errors_only[(e or "")[:120]] = errors_only.get((e or "")[:120], 0) + 1
    contradictions = []
    for sid, s in snapshot.items():
        # A task refused before it was stored gets a failed task_end and has no row: that is
        # the wire contract's refusal (counted in ended_otherwise), not a contradiction.
        refused = s[0] == "failed" and sid not in db_states
        if s[0] is not None and not refused and db_states.get(sid) != s[0]:
            contradictions.append((sid, s[0], db_states.get(sid)))
    ends = sorted(t.ended_at for t in record.tasks.values()
                  if t.end_status == "completed" and t.ended_at is not None)
    # The longest time without any completed task while the load ran (a gap that begins
    # before the load's end counts in full, however late the next completion comes).
    pause, pause_at = 0.0, None
    prev = 0.0
    for e in ends + [time.monotonic() - T0]:
        if prev > load_end:
            break
        if e - prev > pause:
            pause, pause_at = e - prev, prev
        prev = e
    return {
        "fault": fault, "scale": scale, "submitted": len(snapshot), "completed": len(completed),
        "ended_otherwise": ended_other, "no_task_end_live": len(no_end_live),
        "no_task_end_socket_lost": len(no_end_lost), "no_task_end_examples": no_end[:5],
        "errors_without_task_end": errors_only,
        "non_terminal": {state: int(n) for state, n in non_terminal},
        "twice_by_response_id": twice_id, "twice_by_step": twice_step,
        "gaps": int(gaps[0][0]), "contradictions": contradictions[:10],
        "contradiction_count": len(contradictions),
        "longest_pause_secs": round(pause, 1), "longest_pause_from": round(pause_at or 0, 1),
        "readyz": readyz, "afterwards": afterwards, "events": events,
        "reconnects": record.reconnects, "device_errors": summarise(record.device_errors),
        "client_errors": summarise(record.client_errors),
        "refused_registrations": summarise(record.refused_registrations),
    }


def summarise(items):
    counts = {}
    for _, _, text in items:
        key = (text or "")[:140]
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:6])


async def check_afterwards(cluster, cfg, run_id):
    """Fresh tasks after settling: a fresh device on each gateway, driven by a constellation
    on the other; one task on every load device from gateway B; and a REST task."""
    record = load.Record()
    stop = load.Stop()
    stop.submitting = True
    loop = asyncio.get_running_loop()
    devs = []
    readies = []
    for g in ("a", "b"):
        ev = asyncio.Event()
        readies.append(ev)
        devs.append(asyncio.ensure_future(load.device(record, stop, cluster.ws_url(g), f"fresh-{g}", T0, ev)))
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in readies)), 10)
    except asyncio.TimeoutError:
        pass
    runs = [load.constellation(record, stop, cluster.ws_url("b"), "after-a@fresh-a", "fresh-a",
                               run_id, T0, count=1, phase="afterwards"),
            load.constellation(record, stop, cluster.ws_url("a"), "after-b@fresh-b", "fresh-b",
                               run_id, T0, count=1, phase="afterwards")]
    for d in range(cfg["devices"]):
        runs.append(load.constellation(record, stop, cluster.ws_url("b"), f"after{d}@dev{d}", f"dev{d}",
                                       run_id, T0, count=1, phase="afterwards"))
    rest = asyncio.ensure_future(loop.run_in_executor(None, rest_task, cluster, "fresh-b"))
    try:
        await asyncio.wait_for(asyncio.gather(*runs), AFTERWARDS_SECS[cluster.scale])
    except asyncio.TimeoutError:
        pass
    rest_result = await rest
    stop.closing.set()
    await asyncio.gather(*devs, return_exceptions=True)
    total = len(runs)
    ok = sum(1 for t in record.tasks.values() if t.end_status == "completed")
    failed = {sid: (t.end_status, t.end_error or (t.errors[:1] or [None])[0]) for sid, t in record.tasks.items()
              if t.end_status != "completed"}
    return {"ws_completed": ok, "ws_total": total, "ws_failures": dict(list(failed.items())[:5]),
            "rest": rest_result, "twice": record.twice()}


def rest_task(cluster, target):
    """POST /api/tasks to the leading sessions replica, then waits for the task to end."""
    body = {"version": 1, "description": "aip faults: afterwards over REST",
            "originating_agent_id": "aip-faults", "target_id": target, "task_name": "faults-rest",
            "steps": load.echo_steps()}
    status, task = http_json("POST", f"{cluster.rest_url()}/api/tasks", body)
    if status != 201:
        return f"POST refused: {status} {task}"
    task_id = task.get("task_id") or task.get("id")
    end = time.monotonic() + AFTERWARDS_SECS[cluster.scale]
    state = None
    while time.monotonic() < end:
        _, view = http_json("GET", f"{cluster.rest_url()}/api/tasks/{task_id}")
        state = view.get("state") if isinstance(view, dict) else None
        if state in TERMINAL:
            return state
        time.sleep(0.3)
    return f"still {state}"


def scan_logs(cluster):
    """Counts of panics and of the most frequent WARN/ERROR lines per service log."""
    out = {}
    for name in os.listdir(cluster.logs):
        path = os.path.join(cluster.logs, name)
        panics, lines = 0, {}
        with open(path, errors="replace") as f:
            for line in f:
                if "panicked" in line:
                    panics += 1
                line = ANSI.sub("", line)
                if " WARN " in line or " ERROR " in line:
                    # without the timestamp; the message's start
                    key = line.split(" ", 1)[-1].strip()[:150]
                    lines[key] = lines.get(key, 0) + 1
        top = dict(sorted(lines.items(), key=lambda kv: -kv[1])[:4])
        if panics or top:
            out[name] = {"panics": panics, "warn_error_lines": sum(lines.values()), "top": top}
    return out


def run_one(fault, scale, keep, results_dir):
    workdir = tempfile.mkdtemp(prefix=f"aip-faults-{fault}-")
    cluster = Cluster(fault, scale, workdir)
    log(f"{fault}: working directory {workdir}")
    started = time.monotonic()
    try:
        cluster.start_infra()
        cluster.start_broker()
        result = asyncio.run(drive(cluster, fault, scale))
    except Exception as e:  # a run that could not even finish is a row of its own
        result = {"fault": fault, "scale": scale, "harness_error": repr(e)}
    finally:
        cluster.teardown()
    result["logs"] = scan_logs(cluster)
    result["secs"] = round(time.monotonic() - started, 1)
    dest = os.path.join(results_dir, fault)
    shutil.copytree(cluster.logs, os.path.join(dest, "logs"), dirs_exist_ok=True)
    with open(os.path.join(dest, "result.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def row(r):
    if "harness_error" in r:
        return [r["fault"], "-", "-", "-", "-", "-", f"harness error: {r['harness_error'][:80]}", "-"]
    nt = sum(r["non_terminal"].values())
    nt_text = "0" if nt == 0 else f"**{nt}** " + ", ".join(f"{k} {v}" for k, v in r["non_terminal"].items())
    no_end = r["no_task_end_live"]
    no_end_text = str(no_end) if no_end == 0 else f"**{no_end}**"
    if r["no_task_end_socket_lost"]:
        no_end_text += f" (+{r['no_task_end_socket_lost']} socket died)"
    other = sum(r["ended_otherwise"].values())
    completed = f"{r['completed']:,}" + (f" (+{other} failed/canceled)" if other else "")
    twice = r["twice_by_response_id"] + r["twice_by_step"]
    a = r["afterwards"]
    after_ok = a["ws_completed"] == a["ws_total"] and a["rest"] == "completed"
    after = ("✅" if after_ok else "❌") + f" {a['ws_completed']}/{a['ws_total']} WS, REST {a['rest']}"
    ready_bad = {k: v for k, v in r["readyz"].items() if v != 200}
    sessions_ok = any(v == 200 for k, v in r["readyz"].items() if k.startswith("sessions"))
    ready_bad = {k: v for k, v in ready_bad.items() if not (k.startswith("sessions") and sessions_ok)}
    ready = "200" if not ready_bad else ", ".join(f"{k} {v}" for k, v in ready_bad.items())
    return [r["fault"], completed, no_end_text, nt_text, str(twice) if twice == 0 else f"**{twice}**",
            str(r["gaps"]) if r["gaps"] == 0 else f"**{r['gaps']}**", after, ready,
            f"{r['longest_pause_secs']} s (from {r['longest_pause_from']} s)"]


HEADER = ["fault", "completed", "no task_end", "non-terminal after settling", "commands run twice",
          "gaps", "afterwards", "readyz", "longest pause"]


def table(results):
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in results:
        lines.append("| " + " | ".join(row(r)) + " |")
    return "\n".join(lines)


def clean(r):
    if "harness_error" in r:
        return False
    a = r["afterwards"]
    return (r["no_task_end_live"] == 0 and not r["non_terminal"] and r["twice_by_response_id"] == 0
            and r["twice_by_step"] == 0 and r["gaps"] == 0 and a["ws_completed"] == a["ws_total"]
            and a["rest"] == "completed" and r["contradiction_count"] == 0
            and not any(v.get("panics") for v in r["logs"].values()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=SCALES, default="small")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, from: {', '.join(FAULTS)}")
    p.add_argument("--keep", action="store_true", help="keep the throwaway directories")
    p.add_argument("--results", default=None, help="directory of logs and result.json per run")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every row is clean")
    p.add_argument("--registry-liveness-ms", type=int, default=None,
                   help="the registry's liveness window (default: the scale's)")
    args = p.parse_args()
    if args.registry_liveness_ms is not None:
        SCALES[args.scale]["env"]["AIP_REGISTRY__LIVENESS_MS"] = str(args.registry_liveness_ms)
    if os.geteuid() != 0:
        sys.exit("faults: needs root (initdb as postgres via runuser; ip netns for the partition)")
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    for f in faults:
        if f not in FAULTS:
            sys.exit(f"faults: unknown fault {f}; known: {', '.join(FAULTS)}")
    results_dir = args.results or os.path.join(ROOT, "bench", "faults", "results",
                                               f"{args.scale}-{time.strftime('%Y%m%dT%H%M%S')}")
    os.makedirs(results_dir, exist_ok=True)
    results = []
    for fault in faults:
        r = run_one(fault, args.scale, args.keep, results_dir)
        results.append(r)
        log(f"{fault}: done in {r['secs']}s: {json.dumps(row(r), ensure_ascii=False)}")
    text = table(results)
    with open(os.path.join(results_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"\ndetails (errors seen, log lines, timeline): {results_dir}/<fault>/result.json")
    if args.strict and not all(clean(r) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""docker-compose.yml run without Docker: every service of the file started natively on
loopback with its own command and environment, in the file's start order, each replica on a
loopback address of its own (127.N.S.R: one N per run, S per service, R per replica) and its
container port, so the file's ports stay as they are.

What stands in for what the machine cannot run:
- a container's name in DNS: a small DNS server (`Dns`) that answers each service's name
  with the addresses of its running replicas, as Docker's embedded DNS does; HAProxy asks it
  (LB_DNS), the aip services are given addresses directly in their URLs;
- `postgres`: the machine's PostgreSQL, a database of the run's own;
- `jaeger`: an OTLP/gRPC receiver (`OtlpReceiver`) on its address and port 4317;
- `nats`: the machine's nats-server binary run with the file's command and configuration
  (deploy/nats: its users and permissions), on the run's address and a directory of its own;
- a volume mount: its host path; `restart:` policies: the test, which restarts what it stops;
- `service_healthy`: the service's own health check command, run natively.

The environment of every aip service is the file's, with these changes only: host names in
URLs become addresses, `0.0.0.0` becomes the replica's address, the database URL names the
run's database on the machine's PostgreSQL, HOSTNAME is set as Docker sets it.
"""

import concurrent.futures
import os
import random
import re
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import deployfiles as d

PG_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
# What the compose file's container ports are for the aip services and HAProxy.
PUBLIC_PORT = 5000


def log(message):
    print(f"[native {time.strftime('%H:%M:%S')}] {message}", flush=True)


class _Stillness:
    """Seconds the machine stood still, as a thread that wakes every half second sees them.
    A paused virtual machine (seen on these machines: tens of seconds with every process
    stopped, this one included) moves the clock on without the broker having had the time."""

    TICK = 0.5
    # Lateness of one tick that counts as standing still rather than as a busy machine.
    STILL_SECS = 3.0

    def __init__(self):
        self.total = 0.0
        self.lock = threading.Lock()
        threading.Thread(target=self.watch, daemon=True).start()

    def watch(self):
        last = time.monotonic()
        while True:
            time.sleep(self.TICK)
            now = time.monotonic()
            late = now - last - self.TICK
            if late > self.STILL_SECS:
                print(f"[native {time.strftime('%H:%M:%S')}] the machine stood still for {late:.0f}s; "
                      "deadlines do not count it", flush=True)
                with self.lock:
                    self.total += late
            last = now

    def seconds(self):
        with self.lock:
            return self.total


STILLNESS = _Stillness()


class Deadline:
    """`secs` from now, not counting the time the machine stood still (`_Stillness`)."""

    def __init__(self, secs):
        self.end = time.monotonic() + secs
        self.still = STILLNESS.seconds()

    def passed(self):
        return time.monotonic() - (STILLNESS.seconds() - self.still) > self.end


def within(secs, condition, what, pause=0.2):
    """Waits until `condition()` is truthy (and returns it), at most `secs` (see `Deadline`)."""
    deadline = Deadline(secs)
    while True:
        value = condition()
        if value:
            return value
        if deadline.passed():
            raise AssertionError(f"not within {secs}s: {what}")
        time.sleep(pause)


def http(method, url, body=None, headers=None, timeout=10.0):
    """(status, body bytes) of one request; (None, error) when nothing answered."""
    import json
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={
        **({"content-type": "application/json"} if data is not None else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return None, repr(e).encode()


# --- Docker's embedded DNS -------------------------------------------------------------------


class Dns:
    """A DNS server over UDP answering A queries for the compose services' names with the
    addresses of their running replicas (Docker's embedded DNS, for HAProxy's resolvers)."""

    def __init__(self, address, lookup):
        self.lookup = lookup
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 0))  # any port: HAProxy is told it (LB_DNS)
        self.address = "%s:%d" % self.sock.getsockname()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.running = True
        self.thread.start()

    def serve(self):
        while self.running:
            try:
                query, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            try:
                self.sock.sendto(self.answer(query), peer)
            except Exception:  # a malformed query gets no answer, as from a real server
                continue

    def answer(self, query):
        ident, flags = struct.unpack("!HH", query[:4])
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1:i + 1 + query[i]].decode().lower())
            i += 1 + query[i]
        qtype, _ = struct.unpack("!HH", query[i + 1:i + 5])
        question = query[12:i + 5]
        addresses = self.lookup(".".join(labels))
        rcode = 3 if addresses is None else 0  # NXDOMAIN for a name no service has
        answers = [a for a in (addresses or [])] if qtype == 1 else []
        header = struct.pack("!HHHHHH", ident, 0x8480 | (flags & 0x0100) | rcode, 1, len(answers), 0, 0)
        records = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(a) for a in answers)
        return header + question + records

    def close(self):
        self.running = False
        self.sock.close()


# --- Jaeger's OTLP receiver ------------------------------------------------------------------


class OtlpReceiver:
    """An OTLP/gRPC trace endpoint keeping every span: (service, name, trace id, attributes)."""

    def __init__(self, address, port):
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans = []
        self.lock = threading.Lock()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with receiver.lock:
                    for resource_spans in request.resource_spans:
                        service = next((a.value.string_value for a in resource_spans.resource.attributes
                                        if a.key == "service.name"), "")
                        for scope in resource_spans.scope_spans:
                            for span in scope.spans:
                                attributes = {a.key: a.value.string_value for a in span.attributes}
                                receiver.spans.append((service, span.name, span.trace_id.hex(), attributes))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        bound = self.server.add_insecure_port(f"{address}:{port}")
        if bound != port:
            raise AssertionError(f"the OTLP receiver could not listen on {address}:{port}")
        self.server.start()

    def snapshot(self):
        with self.lock:
            return list(self.spans)

    def close(self):
        self.server.stop(0)


# --- processes ---------------------------------------------------------------------------------


class Proc:
    """One replica of a compose service, run natively (the test may signal only these)."""

    def __init__(self, name, replica, address, argv, env, logfile):
        self.name, self.replica, self.address = name, replica, address
        self.argv, self.env, self.logfile = argv, env, logfile
        self.popen = None

    @property
    def label(self):
        return f"{self.name}-{self.replica}"

    def start(self):
        with open(self.logfile, "ab") as out:
            self.popen = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def alive(self):
        return self.popen is not None and self.popen.poll() is None

    def terminate(self, grace=40.0):
        """SIGTERM, as `docker compose stop` and Kubernetes send it; the exit code."""
        if not self.alive():
            return self.popen.returncode if self.popen else None
        self.popen.send_signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"{self.label} did not stop within {grace}s of SIGTERM")

    def kill(self):
        if self.alive():
            self.popen.kill()
            self.popen.wait()


class Cluster:
    """docker-compose.yml, natively."""

    def __init__(self, scale=None):
        # `docker compose up --scale name=N`: replicas instead of the file's deploy.replicas.
        self.scale = scale or {}
        self.compose = d.compose()
        self.services = self.compose["services"]
        self.dir = tempfile.mkdtemp(prefix="aip-compose-native-")
        self.logs = os.path.join(self.dir, "logs")
        os.makedirs(self.logs)
        self.net = random.randint(64, 250)
        self.index = {name: i + 1 for i, name in enumerate(self.services)}
        self.procs = {}  # label -> Proc
        self.database = f"aip_compose_{os.getpid()}_{random.randint(0, 1 << 30)}"
        self.dns = None
        self.otlp = None

    # --- addresses and rewriting ----------------------------------------------------------
    def address(self, service, replica=1):
        return f"127.{self.net}.{self.index[service]}.{replica}"

    def running_addresses(self, name):
        if name not in self.services:
            return None
        return [p.address for p in self.procs.values() if p.name == name and p.alive()]

    def public_url(self, scheme="http"):
        return f"{scheme}://{self.address('lb')}:{PUBLIC_PORT}"

    def host_path(self, service, path):
        """A container path as the host path its volume mounts."""
        for volume in self.services[service].get("volumes", []):
            parts = volume.split(":")
            if len(parts) >= 2 and parts[0].startswith("./") and path.startswith(parts[1]):
                return os.path.join(d.ROOT, parts[0][2:]) + path[len(parts[1]):]
        return path

    def database_url(self):
        return PG_URL.rsplit("/", 1)[0] + "/" + self.database

    def rewrite(self, name, replica, env):
        out = {}
        for key, value in env.items():
            if key == "AIP_DATABASE_URL":
                value = self.database_url()
            else:
                value = re.sub(r"(?<=//)([a-z][a-z0-9-]*)(?=:\d+)",
                               lambda m: self.address(m.group(1)) if m.group(1) in self.services else m.group(1),
                               value)
                value = re.sub(r"^0\.0\.0\.0:", self.address(name, replica) + ":", value)
            out[key] = value
        out["HOSTNAME"] = f"{name}-{replica}"
        return out

    def native_argv(self, name, argv):
        program = argv[0]
        if program in d.AIP_BINARIES:
            path = d.binary(program)
        else:
            path = d.program(program)
        return [path] + [self.host_path(name, a) for a in argv[1:]]

    # --- start ----------------------------------------------------------------------------
    def start(self):
        log(f"working directory {self.dir}; addresses 127.{self.net}.S.R")
        subprocess.run(["psql", PG_URL, "-qc", f'CREATE DATABASE "{self.database}"'], check=True,
                       capture_output=True)
        self.dns = Dns(f"127.{self.net}.0.53", self.running_addresses)
        started = set()
        order = self.start_order()
        for name in order:
            self.wait_dependencies(name)
            self.start_service(name)
            started.add(name)
        log("every service is up: " + ", ".join(order))

    def start_order(self):
        order, seen = [], set()

        def visit(name):
            if name in seen:
                return
            seen.add(name)
            for dep in self.services[name].get("depends_on") or {}:
                visit(dep)
            order.append(name)
        for name in self.services:
            visit(name)
        return order

    def wait_dependencies(self, name):
        for dep, rule in (self.services[name].get("depends_on") or {}).items():
            condition = rule["condition"] if isinstance(rule, dict) else "service_started"
            if condition == "service_completed_successfully":
                procs = [p for p in self.procs.values() if p.name == dep]
                for p in procs:
                    code = p.popen.wait(120)
                    if code != 0:
                        raise AssertionError(f"{p.label} exited with {code}; log {p.logfile}")
            elif condition == "service_healthy":
                for p in [p for p in self.procs.values() if p.name == dep]:
                    within(60, lambda p=p: self.healthy(p), f"{p.label} healthy (log {p.logfile})", 0.5)

    def healthy(self, proc):
        if not proc.alive():
            raise AssertionError(f"{proc.label} exited with {proc.popen.returncode}; log {proc.logfile}")
        if proc.name == "nats":
            return http("GET", f"http://127.0.0.1:{self.nats_monitor}/healthz", timeout=2)[0] == 200
        test = (self.services[proc.name].get("healthcheck") or {}).get("test")
        if not test:
            return True
        assert test[0] == "CMD", test
        result = subprocess.run(self.native_argv(proc.name, test[1:]), env=proc.env,
                                capture_output=True, timeout=30)
        return result.returncode == 0

    def start_service(self, name):
        service = self.services[name]
        if name == "postgres":
            return  # the machine's, with the run's own database
        if name == "jaeger":
            self.otlp = OtlpReceiver(self.address(name), 4317)
            return
        for replica in range(1, self.scale.get(name, d.replicas(service)) + 1):
            self.procs[f"{name}-{replica}"] = self.make(name, replica)
            self.procs[f"{name}-{replica}"].start()

    def make(self, name, replica):
        service = self.services[name]
        argv = self.native_argv(name, d.argv(service["command"]))
        env = d.environment_of(service)
        address = self.address(name, replica)
        if name == "nats":
            # The file's command and configuration; only the listener, the monitoring port and
            # the store move (nats-server's flags override the file).
            self.nats_monitor = free_port()
            argv = [argv[0]] + [self.nats_config(a) for a in argv[1:]]
            argv += ["-a", address, "-p", "4222", "-m", str(self.nats_monitor)]
        elif name == "lb":
            env = dict(env)
            assert env["LB_BIND"] == f":{PUBLIC_PORT}", env
            env["LB_BIND"] = f"{address}:{PUBLIC_PORT}"
            env["LB_DNS"] = self.dns.address
        else:
            env = self.rewrite(name, replica, env)
        return Proc(name, replica, address, argv, env, os.path.join(self.logs, f"{name}-{replica}.log"))

    def nats_config(self, path):
        """The configuration folder mounted into the NATS container, copied with its named
        volume's mount point (the JetStream store) replaced by the run's own directory."""
        folder = os.path.dirname(path)
        if not os.path.isdir(folder) or not path.endswith(".conf"):
            return path
        copy = os.path.join(self.dir, "nats-config")
        os.makedirs(copy, exist_ok=True)
        volumes = {v.split(":")[1]: os.path.join(self.dir, "volume-" + v.split(":")[0])
                   for v in self.services["nats"].get("volumes", []) if not v.startswith(".")}
        for name in os.listdir(folder):
            with open(os.path.join(folder, name)) as f:
                text = f.read()
            for mount, local in volumes.items():
                text = text.replace(f'"{mount}"', f'"{local}"')
            with open(os.path.join(copy, name), "w") as f:
                f.write(text)
        return os.path.join(copy, os.path.basename(path))

    def restart(self, proc):
        """What `restart: unless-stopped` (or a Deployment) does: the same replica again."""
        fresh = self.make(proc.name, proc.replica)
        fresh.start()
        self.procs[fresh.label] = fresh
        return fresh

    # --- state --------------------------------------------------------------------------
    def replicas_of(self, name):
        return [p for p in self.procs.values() if p.name == name]

    def readyz(self, proc, port):
        return http("GET", f"http://{proc.address}:{port}/readyz", timeout=3)[0]

    def leader(self):
        leaders = [p for p in self.replicas_of("sessions") if p.alive() and self.readyz(p, 5002) == 200]
        return leaders[0] if len(leaders) == 1 else None

    def psql(self, sql):
        result = subprocess.run(["psql", self.database_url(), "-At", "-F", "\t", "-c", sql],
                                capture_output=True, text=True, timeout=60, check=True)
        return [line.split("\t") for line in result.stdout.splitlines() if line]

    def panics(self):
        found = []
        for name in os.listdir(self.logs):
            with open(os.path.join(self.logs, name), errors="replace") as f:
                if "panicked" in f.read():
                    found.append(name)
        return found

    def stop(self):
        for proc in reversed(list(self.procs.values())):
            try:
                proc.terminate(grace=30)
            except AssertionError as e:
                log(str(e))
        if self.otlp:
            self.otlp.close()
        if self.dns:
            self.dns.close()
        subprocess.run(["psql", PG_URL, "-qc", f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)'],
                       capture_output=True)

    def remove(self):
        """Deletes the run's directory (logs included): after a run that passed."""
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

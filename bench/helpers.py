#!/usr/bin/env python3
"""Small helpers for the bench/ scripts (python3 standard library only).

Subcommands:
  free-port                      print a free TCP port on 127.0.0.1
  nats-info [--url U]            print the NATS server's INFO as JSON
  nats-streams [--url U] [--prefix P]
                                 list JetStream streams (only those of prefix P: `P_*`)
  nats-delete-streams --prefix P [--url U]
                                 delete the JetStream streams of subject prefix P
  pg-pids --db NAME              pids of PostgreSQL worth sampling for a run on database
                                 NAME: the postmaster, its long-lived helpers and the
                                 backends connected to NAME
  alive PID...                   print those of the pids that are still running
  machine [--nats-url U] [--pg-host H] [--pg-port P] [--pg-user U]
                                 print the machine's description as JSON
  annotate FILE [--mode M] [--gateways N] [--label L] [--command ARGV_JSON]...
                                 add a `bench_script` object to an `aip bench --json` report
"""

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
import uuid
from urllib.parse import urlparse


# --- NATS (text protocol, enough for JetStream API requests) -----------------


class Nats:
    """A minimal NATS client: CONNECT, one inbox subscription, request/reply."""

    def __init__(self, url, timeout=5.0):
        parsed = urlparse(url if "://" in url else "nats://" + url)
        host = parsed.hostname or "127.0.0.1"
        port = parsed.port or 4222
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.buf = b""
        line = self._line()
        if not line.startswith(b"INFO "):
            raise RuntimeError(f"NATS at {host}:{port} did not say INFO: {line!r}")
        self.info = json.loads(line[5:])
        connect = {"verbose": False, "pedantic": False, "headers": False, "protocol": 1,
                   "name": "aip-bench-helpers"}
        self.inbox = "_INBOX.aipbench." + uuid.uuid4().hex
        self._send(f"CONNECT {json.dumps(connect)}\r\nSUB {self.inbox}.* 1\r\nPING\r\n")
        while True:
            line = self._line()
            if line == b"PONG":
                break
            if line.startswith(b"-ERR"):
                raise RuntimeError(f"NATS refused the connection: {line.decode()}")
        self.n = 0

    def _send(self, text):
        self.sock.sendall(text.encode() if isinstance(text, str) else text)

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            raise RuntimeError("NATS closed the connection")
        self.buf += data

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n):
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def request(self, subject, payload=b""):
        self.n += 1
        reply = f"{self.inbox}.{self.n}"
        if isinstance(payload, str):
            payload = payload.encode()
        self._send(f"PUB {subject} {reply} {len(payload)}\r\n".encode() + payload + b"\r\n")
        while True:
            line = self._line()
            if line == b"PING":
                self._send("PONG\r\n")
            elif line.startswith(b"MSG "):
                parts = line.decode().split()
                size = int(parts[-1])
                data = self._exact(size)
                if parts[1] == reply:
                    return json.loads(data) if data else {}
            elif line.startswith(b"-ERR"):
                raise RuntimeError(f"NATS error: {line.decode()}")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def stream_prefix(subject_prefix):
    # proto_schemas::subjects: the prefix with `.` as `_`, then `_frames` / `_blobs`.
    return subject_prefix.replace(".", "_") + "_"


def list_streams(nats):
    names, offset = [], 0
    while True:
        answer = nats.request("$JS.API.STREAM.NAMES", json.dumps({"offset": offset}))
        if "error" in answer:
            raise RuntimeError(f"listing streams: {answer['error']}")
        page = answer.get("streams") or []
        names.extend(page)
        offset += len(page)
        if not page or offset >= answer.get("total", 0):
            return names


def cmd_nats_info(args):
    nats = Nats(args.url)
    print(json.dumps(nats.info))
    nats.close()


def cmd_nats_streams(args):
    nats = Nats(args.url)
    names = list_streams(nats)
    nats.close()
    if args.prefix:
        names = [n for n in names if n.startswith(stream_prefix(args.prefix))]
    for name in sorted(names):
        print(name)


def cmd_nats_delete_streams(args):
    if not re.fullmatch(r"bench[A-Za-z0-9_]+", args.prefix):
        # Only ever delete what the bench scripts made.
        sys.exit(f"refusing to delete the streams of prefix {args.prefix!r}: "
                 "only prefixes made by bench/ (bench<letters/digits>) are cleaned up")
    nats = Nats(args.url)
    mine = [n for n in list_streams(nats) if n.startswith(stream_prefix(args.prefix))]
    for name in mine:
        answer = nats.request(f"$JS.API.STREAM.DELETE.{name}")
        if answer.get("success"):
            print(f"deleted stream {name}")
        else:
            print(f"could not delete stream {name}: {answer.get('error')}", file=sys.stderr)
    nats.close()


# --- processes ---------------------------------------------------------------


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def processes():
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            comm = read(f"/proc/{entry}/comm")
            cmdline = read(f"/proc/{entry}/cmdline")
            if comm is None or cmdline is None:
                continue
            yield int(entry), comm.decode(errors="replace").strip(), \
                cmdline.replace(b"\0", b" ").decode(errors="replace").strip()


CLIENT_BACKEND = re.compile(r"(\d+\.\d+\.\d+\.\d+|\[local\]|[0-9a-f:]+)\(\d+\)|\[local\]")
LONG_LIVED_HELPERS = ("checkpointer", "background writer", "walwriter",
                      "autovacuum launcher", "logical replication launcher")


def cmd_pg_pids(args):
    pids = []
    for pid, comm, cmdline in processes():
        if comm != "postgres":
            continue
        if not cmdline.startswith("postgres:"):
            pids.append(pid)  # the postmaster (its command line is its path)
        elif CLIENT_BACKEND.search(cmdline):
            if f" {args.db} " in f" {cmdline} ":
                pids.append(pid)
        elif any(helper in cmdline for helper in LONG_LIVED_HELPERS):
            pids.append(pid)
    print(" ".join(str(p) for p in sorted(pids)))


def cmd_alive(args):
    print(" ".join(p for p in args.pids if os.path.exists(f"/proc/{p}/stat")))


# --- the machine -------------------------------------------------------------


def run_text(argv, cwd=None):
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def cmd_machine(args):
    cpuinfo = (read("/proc/cpuinfo") or b"").decode(errors="replace")
    model = next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines()
                  if l.startswith("model name")), platform.processor() or None)
    meminfo = (read("/proc/meminfo") or b"").decode(errors="replace")
    mem_kb = next((int(l.split()[1]) for l in meminfo.splitlines()
                   if l.startswith("MemTotal:")), None)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = run_text(["git", "rev-parse", "HEAD"], cwd=repo)
    dirty = run_text(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    described = {
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hostname": socket.gethostname(),
        "cores": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_kb / 1024 / 1024, 1) if mem_kb else None,
        "kernel": platform.release(),
        "os": (dict(l.split("=", 1) for l in (read("/etc/os-release") or b"").decode()
                    .splitlines() if "=" in l).get("PRETTY_NAME", "").strip('"') or None),
        "git_commit": commit,
        "git_dirty": bool(dirty) if commit else None,
        "rustc": run_text(["rustc", "--version"]),
        "nats_version": None,
        "postgres_version": None,
    }
    if args.nats_url:
        try:
            nats = Nats(args.nats_url, timeout=2)
            described["nats_version"] = nats.info.get("version")
            nats.close()
        except (OSError, RuntimeError):
            pass
    if args.pg_host:
        described["postgres_version"] = run_text(
            ["psql", "-h", args.pg_host, "-p", str(args.pg_port), "-U", args.pg_user, "-d",
             "postgres", "-XtAc", "SHOW server_version"])
    print(json.dumps(described, indent=2))


# --- reports -----------------------------------------------------------------


def load(path):
    with open(path) as f:
        return json.load(f)


def save(path, value):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def cmd_annotate(args):
    report = load(args.file)
    meta = report.setdefault("bench_script", {})
    if args.mode:
        meta["mode"] = args.mode
    if args.gateways is not None:
        meta["gateways"] = args.gateways
    if args.label:
        meta["label"] = args.label
    if args.command:
        meta["commands"] = [json.loads(c) for c in args.command]
    save(args.file, report)


# --- main --------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True)
    sub.add_parser("free-port")
    p = sub.add_parser("nats-info")
    p.add_argument("--url", default="nats://127.0.0.1:4222")
    p = sub.add_parser("nats-streams")
    p.add_argument("--url", default="nats://127.0.0.1:4222")
    p.add_argument("--prefix")
    p = sub.add_parser("nats-delete-streams")
    p.add_argument("--url", default="nats://127.0.0.1:4222")
    p.add_argument("--prefix", required=True)
    p = sub.add_parser("pg-pids")
    p.add_argument("--db", required=True)
    p = sub.add_parser("alive")
    p.add_argument("pids", nargs="*")
    p = sub.add_parser("machine")
    p.add_argument("--nats-url")
    p.add_argument("--pg-host")
    p.add_argument("--pg-port", default="5432")
    p.add_argument("--pg-user", default="postgres")
    p = sub.add_parser("annotate")
    p.add_argument("file")
    p.add_argument("--mode")
    p.add_argument("--gateways", type=int)
    p.add_argument("--label")
    p.add_argument("--command", action="append", help="a command line as a JSON array")
    args = parser.parse_args()

    if args.subcommand == "free-port":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            print(s.getsockname()[1])
    elif args.subcommand == "nats-info":
        cmd_nats_info(args)
    elif args.subcommand == "nats-streams":
        cmd_nats_streams(args)
    elif args.subcommand == "nats-delete-streams":
        cmd_nats_delete_streams(args)
    elif args.subcommand == "pg-pids":
        cmd_pg_pids(args)
    elif args.subcommand == "alive":
        cmd_alive(args)
    elif args.subcommand == "machine":
        cmd_machine(args)
    elif args.subcommand == "annotate":
        cmd_annotate(args)


if __name__ == "__main__":
    try:
        main()
    except (OSError, RuntimeError) as e:
        sys.exit(f"helpers.py: {e}")

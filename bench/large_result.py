#!/usr/bin/env python3
"""Large results, end to end: a UFO device answers a command with a `command_results` frame
of N MiB, and the time is measured from the first byte the device sends to the constellation
holding the whole `task_end` (which carries the result). The broker processes' RSS is read
before the task, right after it, and after a settling pause, to see whether memory is returned.

Usage (bench/distributed.sh and bench/dev.sh run it with BENCH_COMMAND):
    bench/large_result.py --dir DIR --url ws://HOST:PORT/ws [--url ...] --rest URL --pid PID...
        [--mib 90] [--runs 3] [--settle 10] [--keep-open]

With --keep-open (or BENCH_LARGE_KEEP_OPEN=1) the device and constellation of every run stay
connected until the RSS after the pause is read, as UFO's clients do between tasks (the device
reads its own task_end first, as UFO's does): memory must be returned while the connections
live on, not only when they close.

Writes DIR/large-result.json. With two --url, the device is on the second gateway and the
constellation on the first.
"""

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

import websockets

MIB = 1024 * 1024


def frame(fields):
    base = {
        "type": None, "status": None, "client_type": "device", "session_id": None,
        "task_name": None, "client_id": None, "target_id": None, "request": None,
        "action_results": None, "timestamp": "2026-11-22T02:53:49.028026+00:00",
        "request_id": None, "prev_response_id": None, "error": None, "metadata": None,
    }
    base.update(fields)
    return json.dumps(base)


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def process_name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(pid)


async def recv_type(ws, kind, timeout):
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {kind} frame within {timeout} s")
        message = json.loads(await asyncio.wait_for(ws.recv(), left))
        if message.get("type") == kind:
            return message


async def register(url, fields):
    ws = await websockets.connect(url, max_size=None, open_timeout=10)
    await ws.send(frame({"type": "register", "status": "ok", **fields}))
    reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
    if reply.get("status") != "ok":
        raise RuntimeError(f"registration refused: {reply}")
    return ws


async def one_run(device_url, galaxy_url, mib, run, timeout, kept):
    tag = uuid.uuid4().hex[:8]
    device_id = f"large-{tag}-dev"
    galaxy_id = f"large-{tag}@{device_id}"
    device = await register(device_url, {
        "client_type": "device", "client_id": device_id,
        "metadata": {"platform": "linux", "system_info": {"device_id": device_id, "platform": "linux"}},
    })
    await asyncio.sleep(0.5)  # presence reaches the registry
    galaxy = await register(galaxy_url, {
        "client_type": "constellation", "client_id": galaxy_id, "target_id": device_id,
        "metadata": {"task_name": "large", "type": "constellation_client"},
    })
    steps = [[{"tool_name": "screenshot", "tool_type": "action", "parameters": {}}]]
    await galaxy.send(frame({
        "type": "task", "status": "continue", "client_type": "constellation",
        "client_id": galaxy_id, "target_id": device_id, "task_name": f"large-{tag}",
        "request": "take a screenshot", "session_id": f"large-{tag}-{run}",
        "metadata": {"steps": steps},
    }))
    command = await recv_type(device, "command", timeout)
    payload = "A" * (mib * MIB)
    results = frame({
        "type": "command_results", "status": "continue", "client_type": "device",
        "client_id": device_id, "session_id": command["session_id"],
        "prev_response_id": command.get("response_id"), "request_id": str(uuid.uuid4()),
        "action_results": [{
            "status": "success", "namespace": "bench",
            "call_id": command["actions"][0].get("call_id"),
            "result": {"png_base64": payload},
        }],
    })
    del payload
    started = time.monotonic()
    started_wall = time.time()
    await device.send(results)
    sent = time.monotonic() - started
    end = await recv_type(galaxy, "task_end", timeout)
    elapsed = time.monotonic() - started
    print(f"  started at {time.strftime('%H:%M:%S', time.gmtime(started_wall))}"
          f".{int(started_wall % 1 * 1e6):06d} UTC; sent in {sent:.3f} s", file=sys.stderr)
    got = len(end["result"][0]["results"][0]["result"]["png_base64"])
    del end, results
    ok = got == mib * MIB
    if kept is None:
        await device.close()
        await galaxy.close()
    else:
        # A UFO device reads every frame it is sent; so does this one before it idles. (A
        # client that stops reading leaves the gateway holding the message it is writing.)
        await recv_type(device, "task_end", timeout)
        kept += [device, galaxy]
    return elapsed, ok


async def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--url", action="append", required=True)
    parser.add_argument("--rest")
    parser.add_argument("--pid", action="append", type=int, default=[])
    parser.add_argument("--infra-db")
    parser.add_argument("--mode", default="")
    parser.add_argument("--mib", type=int, default=int(os.environ.get("BENCH_LARGE_MIB", 90)))
    parser.add_argument("--runs", type=int, default=int(os.environ.get("BENCH_LARGE_RUNS", 3)))
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--keep-open", action="store_true",
                        default=os.environ.get("BENCH_LARGE_KEEP_OPEN") == "1")
    args = parser.parse_args()
    galaxy_url, device_url = args.url[0], args.url[-1]

    names = {pid: process_name(pid) for pid in args.pid}
    before = {pid: rss_mib(pid) for pid in args.pid}
    runs = []
    peak = dict(before)
    kept = [] if args.keep_open else None
    for run in range(args.runs):
        elapsed, ok = await one_run(device_url, galaxy_url, args.mib, run, args.timeout, kept)
        for pid in args.pid:
            now = rss_mib(pid)
            if now is not None and (peak[pid] is None or now > peak[pid]):
                peak[pid] = now
        rate = args.mib / elapsed
        runs.append({"seconds": round(elapsed, 3), "mib_per_sec": round(rate, 1), "complete": ok})
        print(f"run {run + 1}: {args.mib} MiB in {elapsed:.2f} s = {rate:.1f} MiB/s"
              f"{'' if ok else ' (RESULT INCOMPLETE)'}", file=sys.stderr)
    await asyncio.sleep(args.settle)
    after = {pid: rss_mib(pid) for pid in args.pid}
    for ws in kept or []:
        await ws.close()
    report = {
        "scenario": "large-result", "mode": args.mode, "mib": args.mib, "runs": runs,
        "connections_kept_open": args.keep_open,
        "rss_mib": [{"pid": pid, "name": names[pid], "before": before[pid],
                     "peak_sampled": peak[pid], f"after_{args.settle:g}s": after[pid]}
                    for pid in args.pid],
    }
    os.makedirs(args.dir, exist_ok=True)
    with open(os.path.join(args.dir, "large-result.json"), "w") as f:
        json.dump(report, f, indent=2)
    for row in report["rss_mib"]:
        print(f"{row['name']}: RSS {row['before']:.1f} → peak {row['peak_sampled']:.1f} → "
              f"{row[f'after_{args.settle:g}s']:.1f} MiB", file=sys.stderr)
    if not all(r["complete"] for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())

#!/usr/bin/env python3
"""Byte flood: N devices register on one gateway and send large `command_results` frames as
fast as the gateway takes them, for a while; the gateway's memory is sampled throughout
(`/proc/PID/status`: VmRSS every 100 ms, VmHWM at the end) and so is its
`aip_gateway_inbound_bytes_in_flight` gauge. What bounds the gateway's memory under such a
flood is its budget of inbound bytes in flight (`max_inbound_bytes_in_flight`).

Usage (bench/byte_flood.sh runs it once per gateway configuration):
    bench/byte_flood.py --url ws://HOST:PORT/ws --pid PID --out FILE [--label TEXT]
        [--clients 20] [--mib 8] [--seconds 20] [--settle 5]
    bench/byte_flood.py streams --nats-url URL --prefix PREFIX
        (creates the frames and blob streams, capped, before the gateway starts)

Writes FILE (JSON). Frames go to the frames stream unread (no session service): the bench
measures the gateway alone.
"""

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import urllib.request
import uuid

import websockets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import Nats  # noqa: E402

MIB = 1024 * 1024


def frame(fields):
    base = {
        "type": None, "status": None, "client_type": "device", "session_id": None,
        "task_name": None, "client_id": None, "target_id": None, "request": None,
        "action_results": None, "timestamp": "2026-11-26T02:53:49.028026+00:00",
        "request_id": None, "prev_response_id": None, "error": None, "metadata": None,
    }
    base.update(fields)
    return json.dumps(base)


def status_kib(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def gauge(metrics_url, name):
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError):
        return None
    return None


async def register(url, device_id):
    ws = await websockets.connect(url, max_size=None, open_timeout=10, ping_interval=None)
    await ws.send(frame({
        "type": "register", "status": "ok", "client_type": "device", "client_id": device_id,
        "metadata": {"platform": "linux", "system_info": {"device_id": device_id, "platform": "linux"}},
    }))
    reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
    if reply.get("status") != "ok":
        raise RuntimeError(f"registration refused: {reply}")
    return ws


async def flood(ws, device_id, payload, stop, counts):
    """Sends COMMAND_RESULTS frames until `stop`; counts what was sent and any ERROR answer."""

    async def read():
        async for message in ws:
            if isinstance(message, str) and '"error"' in message:
                counts["errors"] += 1
                if counts["first_error"] is None:
                    counts["first_error"] = message[:300]

    reader = asyncio.create_task(read())
    # One text, sent again and again: building 8 MiB of JSON per frame would make the
    # generator, not the gateway, the bottleneck.
    text = frame({
        "type": "command_results", "status": "continue", "client_type": "device",
        "client_id": device_id, "session_id": f"{device_id}-s", "prev_response_id": "r1",
        "request_id": str(uuid.uuid4()),
        "action_results": [{"status": "success", "namespace": "bench", "call_id": "c1",
                            "result": {"png_base64": payload}}],
    })
    try:
        while not stop.is_set():
            await ws.send(text)
            counts["frames"] += 1
            counts["bytes"] += len(text)
    except websockets.ConnectionClosed as e:
        counts["closed"] += 1
        counts["close_reason"] = str(e)
    finally:
        reader.cancel()
        await ws.close()


async def run(args):
    metrics_url = args.url.replace("ws://", "http://").rsplit("/ws", 1)[0] + "/metrics"
    payload = "A" * (args.mib * MIB)
    tag = uuid.uuid4().hex[:6]
    clients = [await register(args.url, f"flood-{tag}-{i}") for i in range(args.clients)]
    idle_rss = status_kib(args.pid, "VmRSS")
    counts = {"frames": 0, "bytes": 0, "errors": 0, "first_error": None, "closed": 0,
              "close_reason": None}
    stop = asyncio.Event()
    started = time.monotonic()
    senders = [asyncio.create_task(flood(ws, f"flood-{tag}-{i}", payload, stop, counts))
               for i, ws in enumerate(clients)]
    samples, gauges = [], []
    sampling = threading.Event()

    # In threads, so that the generator's busy event loop does not space the samples out.
    def sample_rss():
        while not sampling.is_set():
            samples.append(status_kib(args.pid, "VmRSS"))
            time.sleep(0.1)

    def sample_gauge():
        while not sampling.is_set():
            gauges.append(gauge(metrics_url, "aip_gateway_inbound_bytes_in_flight"))
            time.sleep(0.5)

    threads = [threading.Thread(target=sample_rss), threading.Thread(target=sample_gauge)]
    for thread in threads:
        thread.start()
    await asyncio.sleep(args.seconds)
    stop.set()
    sampling.set()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    await asyncio.wait(senders, timeout=60)
    hwm = status_kib(args.pid, "VmHWM")
    await asyncio.sleep(args.settle)
    settled = status_kib(args.pid, "VmRSS")
    rss = [s for s in samples if s is not None]
    seen = [g for g in gauges if g is not None]
    return {
        "label": args.label,
        "clients": args.clients,
        "frame_mib": args.mib,
        "seconds": round(elapsed, 1),
        "frames_sent": counts["frames"],
        "mib_sent": round(counts["bytes"] / MIB, 1),
        "mib_per_sec": round(counts["bytes"] / MIB / elapsed, 1),
        "error_frames": counts["errors"],
        "first_error": counts["first_error"],
        "connections_closed": counts["closed"],
        "close_reason": counts["close_reason"],
        "rss_idle_mib": round(idle_rss / 1024, 1) if idle_rss else None,
        "rss_peak_sampled_mib": round(max(rss) / 1024, 1) if rss else None,
        "rss_median_mib": round(sorted(rss)[len(rss) // 2] / 1024, 1) if rss else None,
        "vm_hwm_mib": round(hwm / 1024, 1) if hwm else None,
        "rss_after_settle_mib": round(settled / 1024, 1) if settled else None,
        "in_flight_gauge_max_mib": round(max(seen) / MIB, 1) if seen else None,
        "samples": len(rss),
    }


def streams(args):
    """The frames stream (as the session service makes it) and the blob stream (as the gateway
    makes it), capped at 2 GiB each, discarding the oldest: nobody reads them here, and the
    flood must not fill the disk."""
    nats = Nats(args.nats_url)
    base = args.prefix.replace(".", "_")
    for name, subjects in [(f"{base}_frames", [f"{args.prefix}.frames.>"]),
                           (f"{base}_blobs", [f"{args.prefix}.blobs.>"])]:
        config = {"name": name, "subjects": subjects, "storage": "file", "retention": "limits",
                  "discard": "old", "max_bytes": 2 * 1024 * MIB, "max_age": 3600 * 10**9,
                  "duplicate_window": 120 * 10**9, "num_replicas": 1}
        answer = nats.request(f"$JS.API.STREAM.CREATE.{name}", json.dumps(config))
        if "error" in answer:
            raise SystemExit(f"creating stream {name}: {answer['error']}")
    nats.close()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "streams":
        parser = argparse.ArgumentParser(description="create the streams")
        parser.add_argument("streams")
        parser.add_argument("--nats-url", required=True)
        parser.add_argument("--prefix", required=True)
        streams(parser.parse_args())
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=5.0)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

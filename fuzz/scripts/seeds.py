#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into fuzz/seeds/<target>/.

Seeds: the frame fixtures of proto-schemas, the frames of the captured UFO session (when the
shared spec is beside the repository), and hand-written bus payloads of every decoded type.
The checked-in corpus (fuzz/corpus/) is these seeds plus what the fuzzer found, minimised.
"""
import hashlib
import json
import pathlib
import sys

FUZZ = pathlib.Path(__file__).resolve().parent.parent
REPO = FUZZ.parent
FIXTURES = REPO / "proto-schemas" / "tests" / "fixtures"
CAPTURED = [
    REPO / "proto-schemas" / "tests" / "data" / "ufo-b28183f-flows.jsonl",
    REPO.parent / "shared" / "spec" / "captured" / "ufo-b28183f-flows.jsonl",
]


def write(target, data):
    if isinstance(data, str):
        data = data.encode()
    folder = FUZZ / "seeds" / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


frames = []
for path in sorted(FIXTURES.rglob("*")):
    if path.is_file() and path.suffix in (".json", ".txt") and path.name != "manifest.json":
        frames.append(path.read_bytes())
for path in CAPTURED:
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                frames.append(json.dumps(json.loads(line)["frame"]).encode())
for frame in frames:
    write("frame", frame)

ids = {"", "~", "~41", "~2e", "~2E", "a.b", "*", ">", "a b", "task@device", "\u00e9", "\U0001F600"}
for frame in frames:
    try:
        ids.update(s for s in strings(json.loads(frame)) if len(s) <= 64)
    except ValueError:
        pass
for s in ids:
    write("subject_token", s)

client = json.loads((FIXTURES / "captured" / "09_constellation_session_device_command_results.json").read_text())
register = json.loads((FIXTURES / "captured" / "00_constellation_session_device_register.json").read_text())
tool = {"tool_key": "action::click", "tool_name": "click", "namespace": "ui", "tool_type": "action"}
command = {"tool_name": "click", "parameters": {"x": 1.5}, "tool_type": "action", "call_id": "c1"}
record = {
    "agent_id": "pc-1", "client_type": "device", "status": "available", "platform": "linux",
    "capabilities": ["gui"], "tools": [tool], "system_info": {"cpu_count": 4}, "metadata": {},
    "extensions": ["task_end_result"], "gateway_id": "gw", "connection_id": "c", "load": 0,
    "connected_at": "2026-11-22T02:53:49.028026Z", "last_seen": "2026-11-22T02:53:49+01:00",
}
payloads = [
    {"event": "frame", "version": 1, "gateway_id": "gw", "connection_id": "c", "client_id": "pc-1",
     "client_type": "device", "platform": "linux", "extensions": ["task_end_result"],
     "received_at": "2026-11-22T02:53:49.028026+00:00", "frame": client},
    {"event": "closed", "version": 1, "gateway_id": "gw", "connection_id": "c", "client_id": "pc-1",
     "client_type": "constellation", "reason": "closed"},
    {"version": 1, "task_id": "t", "description": "open notepad", "data": {"a": [1, None]},
     "originating_agent_id": "llm", "priority": -1, "target_id": "pc-1",
     "required_capabilities": ["gui"], "task_name": "n", "steps": [[command]], "driver": True,
     "timeout_secs": 30},
    {"ok": {"decision": "commands", "actions": [command], "agent_name": "LinuxAgent"}},
    {"ok": {"decision": "complete", "result": {"done": True}}},
    {"ok": {"decision": "fail", "error": "no"}},
    {"error": {"detail": "no planner", "error_code": "UNAVAILABLE"}},
    {"version": 1, "gateway_id": "gw", "interval_ms": 1000,
     "alive": [{"agent_id": "pc-1", "connection_id": "c"}], "stopping": False},
    {"version": 1, "agent_id": "pc-1", "client_type": "device", "gateway_id": "gw",
     "connection_id": "c", "principal": "anonymous", "platform": "windows", "target_id": "d",
     "capabilities": ["gui"], "tools": [tool], "system_info": register["metadata"]["system_info"],
     "metadata": register["metadata"], "extensions": ["task_end_result"]},
    {"version": 1, "agent_id": "pc-1", "connection_id": "c", "reason": "closed"},
    {"version": 1, "agent_id": "pc-1"},
    {"version": 1, "capabilities": ["gui"], "client_type": "device", "limit": 3},
    {"ok": {"last_seen": "2026-11-22T02:53:49.028026Z"}},
    {"ok": {"went_offline": True}},
    {"version": 1, "msg_id": "0195f3c2-7d1e-7a40-9b1a-2f4c6d8e0a11"},
    {"version": 1, "gateway_id": "gw"},
    {"ok": {"ended": 3}},
    {"ok": {"agent": record, "replaced_connection": "c0", "replaced_gateway": "gw-old"}},
    {"ok": record},
    {"ok": [record]},
    {"stream": "aip_blobs", "sequences": [1, 2, 3], "size": 2500000},
    # The crash the target found: a claimed size far beyond any body.
    {"stream": "s", "sequences": [], "size": 99999999999},
]
for payload in payloads:
    write("bus_payload", json.dumps(payload))

for target in ("frame", "subject_token", "bus_payload"):
    print(target, len(list((FUZZ / "seeds" / target).iterdir())), file=sys.stderr)

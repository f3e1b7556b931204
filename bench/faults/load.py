"""Closed-loop load of the fault harness: UFO devices and Galaxy-format constellations on
WebSocket, every one of them reconnecting by itself, and a record of what each task's
requester was told and of every command each device received.

Why its own client rather than `aip bench tasks`: the bench stops a client at its first lost
socket and reports counts, while the harness needs every task's outcome by id (to compare
with the database) and every command frame by id (to find a command run twice), across
reconnections.
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import websockets

# Steps of every scripted task: two, as in the runs.
STEPS = 2
# A requester waits this long for a task's task_end before it submits its next task (the
# late task_end is still recorded); long enough for a restart, short enough to keep load up.
TASK_WAIT_SECS = 20.0
# Pause between reconnection attempts of a client whose socket died.
RECONNECT_PAUSE_SECS = 0.5
# Longest wait for the answer to a REGISTER.
REGISTER_TIMEOUT_SECS = 5.0


def now_ts():
    return datetime.now(timezone.utc).isoformat()


def client_frame(kind, status, client_type, client_id, **fields):
    """A UFO ClientMessage with every field present (unset ones null), as UFO sends it."""
    frame = {
        "type": kind, "status": status, "client_type": client_type, "session_id": None,
        "task_name": None, "client_id": client_id, "target_id": None, "request": None,
        "action_results": None, "timestamp": now_ts(), "request_id": None,
        "prev_response_id": None, "error": None, "metadata": None,
    }
    frame.update(fields)
    return json.dumps(frame)


def device_register(device_id):
    return client_frame("register", "ok", "device", device_id, metadata={
        "system_info": {
            "device_id": device_id, "platform": "linux", "os_version": "aip-faults",
            "cpu_count": 2, "memory_total_gb": 8.0, "hostname": "aip-faults",
            "ip_address": "127.0.0.1", "supported_features": ["cli"],
            "platform_type": "computer", "schema_version": "1.0", "custom_metadata": {}},
        "platform": "linux", "registration_time": now_ts()})


def constellation_register(client_id, target):
    return client_frame("register", "ok", "constellation", client_id, target_id=target, metadata={
        "type": "constellation_client", "task_name": "aip_faults", "targeted_device_id": target,
        "capabilities": ["task_distribution"], "version": "2.0", "registration_time": now_ts()})


def echo_steps():
    return [[{"tool_name": "echo", "tool_type": "action", "call_id": None,
              "parameters": {"text": "aip faults", "step": i + 1}}] for i in range(STEPS)]


def constellation_task(client_id, target, session_id, task_name):
    return client_frame("task", "continue", "constellation", client_id, target_id=target,
                        session_id=session_id, task_name=task_name, request="aip faults: echo",
                        metadata={"steps": echo_steps()})


def command_results(device_id, command, request_id):
    results = [{"status": "success", "error": None,
                "result": {"echo": action.get("parameters")}, "namespace": "aip_faults",
                "call_id": action.get("call_id")} for action in command.get("actions") or []]
    return client_frame("command_results", "continue", "device", device_id,
                        session_id=command.get("session_id"),
                        prev_response_id=command.get("response_id"),
                        action_results=results, request_id=request_id)


@dataclass
class Task:
    session_id: str
    submitted_at: float
    gateway: str
    end_status: str | None = None  # the task_end's status
    end_error: str | None = None
    ended_at: float | None = None
    errors: list = field(default_factory=list)  # ERROR frames about this session
    socket_lost: bool = False  # the requester's socket died while the task had no task_end
    phase: str = "load"  # load or afterwards


@dataclass
class Record:
    tasks: dict = field(default_factory=dict)
    # response_id -> how many command frames with it the devices received
    commands_by_response: dict = field(default_factory=dict)
    # (session_id, step) -> how many command frames for that step
    commands_by_step: dict = field(default_factory=dict)
    device_errors: list = field(default_factory=list)
    client_errors: list = field(default_factory=list)
    reconnects: int = 0
    refused_registrations: list = field(default_factory=list)

    def twice(self):
        by_id = sum(1 for n in self.commands_by_response.values() if n > 1)
        by_step = sum(1 for n in self.commands_by_step.values() if n > 1)
        return by_id, by_step


class Stop:
    """Tells the clients when to stop submitting and when to hang up."""

    def __init__(self):
        self.submitting = True
        self.closing = asyncio.Event()


def receive(ws):
    """The next frame, as a future whose failure is read even if nobody awaits it (a socket
    that dies while its client is shutting down)."""
    future = asyncio.ensure_future(ws.recv())
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


async def register(ws, frame):
    await ws.send(frame)
    answer = json.loads(await asyncio.wait_for(ws.recv(), REGISTER_TIMEOUT_SECS))
    if answer.get("type") == "heartbeat" and answer.get("status") != "error":
        return None
    return answer.get("error") or json.dumps(answer)[:200]


async def device(record, stop, url, device_id, t0, ready=None):
    """A UFO device answering every command at once; reconnects when its socket dies."""
    request = 0
    first = True
    while not stop.closing.is_set():
        try:
            async with websockets.connect(url, max_size=None, open_timeout=5) as ws:
                refusal = await register(ws, device_register(device_id))
                if refusal:
                    record.refused_registrations.append((round(time.monotonic() - t0, 1), device_id, refusal))
                    await asyncio.sleep(RECONNECT_PAUSE_SECS)
                    continue
                if first and ready:
                    ready.set()
                first = False
                closing = asyncio.ensure_future(stop.closing.wait())
                while True:
                    recv = receive(ws)
                    done, _ = await asyncio.wait({recv, closing}, return_when=asyncio.FIRST_COMPLETED)
                    if closing in done:
                        recv.cancel()
                        return
                    frame = json.loads(recv.result())
                    kind = frame.get("type")
                    if kind == "command":
                        rid = frame.get("response_id")
                        record.commands_by_response[rid] = record.commands_by_response.get(rid, 0) + 1
                        for action in frame.get("actions") or []:
                            step = (action.get("parameters") or {}).get("step")
                            key = (frame.get("session_id"), step)
                            record.commands_by_step[key] = record.commands_by_step.get(key, 0) + 1
                        request += 1
                        await ws.send(command_results(device_id, frame, f"{device_id}-r{request}"))
                    elif kind == "error":
                        record.device_errors.append((round(time.monotonic() - t0, 1), device_id, frame.get("error")))
        except (OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as e:
            if stop.closing.is_set():
                return
            record.reconnects += 1
            record.client_errors.append((round(time.monotonic() - t0, 1), device_id, f"socket: {e!r}"[:160]))
            await asyncio.sleep(RECONNECT_PAUSE_SECS)


async def constellation(record, stop, url, client_id, target, run_id, t0, count=None,
                        phase="load", ready=None):
    """A Galaxy constellation running two-step tasks one after another on `target`, closed
    loop; reconnects when its socket dies. With `count`, runs that many tasks and returns."""
    m = 0
    first = True
    while not stop.closing.is_set():
        pending = {}
        try:
            async with websockets.connect(url, max_size=None, open_timeout=5) as ws:
                refusal = await register(ws, constellation_register(client_id, target))
                if refusal:
                    record.refused_registrations.append((round(time.monotonic() - t0, 1), client_id, refusal))
                    await asyncio.sleep(RECONNECT_PAUSE_SECS)
                    continue
                if first and ready:
                    ready.set()
                first = False
                waiter = None
                closing = asyncio.ensure_future(stop.closing.wait())
                recv = receive(ws)
                while True:
                    if waiter is None and stop.submitting and (count is None or m < count):
                        task_name = f"{client_id.split('@')[0]}-t{m}"
                        session_id = f"{task_name}@{run_id}"
                        m += 1
                        task = Task(session_id, time.monotonic() - t0, url, phase=phase)
                        record.tasks[session_id] = task
                        pending[session_id] = task
                        await ws.send(constellation_task(client_id, target, session_id, task_name))
                        waiter = (session_id, time.monotonic() + TASK_WAIT_SECS)
                    if waiter is None and count is not None and m >= count and not pending:
                        closing.cancel()
                        recv.cancel()
                        return
                    timeout = max(0.0, waiter[1] - time.monotonic()) if waiter else 1.0
                    done, _ = await asyncio.wait({recv, closing}, timeout=timeout,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if closing in done:
                        recv.cancel()
                        return
                    if recv in done:
                        frame = json.loads(recv.result())
                        recv = receive(ws)
                        sid = frame.get("session_id")
                        task = record.tasks.get(sid)
                        kind = frame.get("type")
                        if kind == "task_end" and task is not None:
                            if task.end_status is None:
                                task.end_status = frame.get("status")
                                task.end_error = frame.get("error")
                                task.ended_at = time.monotonic() - t0
                            pending.pop(sid, None)
                            if waiter and waiter[0] == sid:
                                waiter = None
                        elif kind == "error":
                            if task is not None:
                                task.errors.append(frame.get("error"))
                            else:
                                record.client_errors.append((round(time.monotonic() - t0, 1), client_id, frame.get("error")))
                    elif waiter and time.monotonic() >= waiter[1]:
                        waiter = None  # still pending; the next task goes
        except (OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as e:
            for task in pending.values():
                if task.end_status is None:
                    task.socket_lost = True
            if stop.closing.is_set():
                return
            record.reconnects += 1
            record.client_errors.append((round(time.monotonic() - t0, 1), client_id, f"socket: {e!r}"[:160]))
            await asyncio.sleep(RECONNECT_PAUSE_SECS)

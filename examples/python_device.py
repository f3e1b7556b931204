#!/usr/bin/env python3
"""A UFO-format device agent in Python, for the aip broker.

It speaks AIP exactly as Microsoft UFO's device client does: it registers over a WebSocket,
answers every `command` frame with one `command_results` frame (one Result per Command, in
order, each with its Command's `call_id`; after a failure the rest are `skipped`), echoes a
server `task` frame (what UFO's `POST /api/dispatch` sends) and prints each `task_end`.

Try it:
    aip dev                                                   # the broker, ws://127.0.0.1:5000/ws
    python3 examples/python_device.py --id py-pc --capability py
    aip dispatch --capability py --tool upper --args '{"text":"hi"}' "shout"

Needs: pip install websockets   (see scripts/python-requirements.txt)
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import uuid

import websockets


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


# The tools this device offers, as MCPToolInfo objects (announced at REGISTER, listed by list_tools).
TOOLS = [
    {"tool_key": f"action::{name}", "tool_name": name, "namespace": "python_device",
     "tool_type": "action", "description": description}
    for name, description in [("echo", "returns its parameters"),
                              ("upper", "upper-cases parameters.text"),
                              ("list_tools", "lists these tools")]
]


def run_tool(name, params):
    """Runs one tool; an exception is reported as a failed Result."""
    if name == "echo":
        return params
    if name == "upper":
        return {"text": str(params.get("text", "")).upper()}
    if name == "list_tools":
        return TOOLS
    raise ValueError(f"unknown tool `{name}`")


def command_results(device_id, command):
    """The answer to a `command` frame."""
    results, failed = [], False
    for action in command.get("actions") or []:
        result = {"status": "skipped", "call_id": action.get("call_id"), "namespace": "python_device"}
        if not failed:
            try:
                result.update(status="success", result=run_tool(action["tool_name"], action.get("parameters") or {}))
            except Exception as error:  # a failing tool fails its Result, not the device
                result.update(status="failure", error=str(error))
                failed = True
        results.append(result)
    return {"type": "command_results", "status": command["status"], "client_type": "device",
            "client_id": device_id, "session_id": command.get("session_id"),
            "prev_response_id": command.get("response_id"),  # says which command this answers
            "request_id": str(uuid.uuid4()), "action_results": results, "timestamp": now()}


async def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("AIP_URL", "ws://127.0.0.1:5000/ws"))
    parser.add_argument("--id", default=socket.gethostname())
    parser.add_argument("--capability", action="append", default=[])
    args = parser.parse_args()

    register = {
        "type": "register", "status": "ok", "client_type": "device", "client_id": args.id, "timestamp": now(),
        "metadata": {
            "platform": "linux",  # decides the agent_name of our commands (linux → LinuxAgent)
            "registration_time": now(),
            "capabilities": args.capability,  # what `aip dispatch --capability` looks for
            "tools": TOOLS,
            "system_info": {"device_id": args.id, "platform": "linux", "hostname": socket.gethostname(),
                            "cpu_count": os.cpu_count(), "os_version": platform.platform()},
        },
    }
    # UFO accepts frames up to 100 MiB (screenshots); so do we.
    async with websockets.connect(args.url, max_size=100 * 1024 * 1024) as ws:
        await ws.send(json.dumps(register))
        reply = json.loads(await ws.recv())  # the first server frame answers REGISTER
        if reply.get("type") != "heartbeat":
            raise SystemExit(f"registration refused: {reply.get('error')}")
        print(f"registered as {args.id}", flush=True)

        async def heartbeats():  # UFO devices send one every 120 s; pings keep the socket alive too
            while True:
                await asyncio.sleep(30)
                await ws.send(json.dumps({"type": "heartbeat", "status": "ok", "client_type": "device",
                                          "client_id": args.id, "timestamp": now()}))

        beating = asyncio.create_task(heartbeats())
        async for text in ws:
            frame = json.loads(text)
            kind, session = frame.get("type"), frame.get("session_id")
            if kind == "command":
                answer = command_results(args.id, frame)
                await ws.send(json.dumps(answer))
                for action, result in zip(frame["actions"], answer["action_results"]):
                    print(f"task {session}: {action['tool_name']} -> {result['status']} "
                          f"{json.dumps(result.get('result', result.get('error')))}", flush=True)
            elif kind == "task":  # from POST /api/dispatch: echo it, then commands follow
                await ws.send(json.dumps({"type": "task", "status": "continue", "client_type": "device",
                                          "client_id": args.id, "request": frame.get("user_request"),
                                          "task_name": frame.get("task_name"), "timestamp": now(),
                                          "metadata": {"platform": "linux"}}))
            elif kind == "task_end":
                print(f"task {session}: task_end {frame['status']} {json.dumps(frame.get('result'))}", flush=True)
            elif kind == "error":
                print(f"broker error: {frame.get('error')}", flush=True)
        beating.cancel()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass

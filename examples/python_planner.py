#!/usr/bin/env python3
"""A remote planner for the aip broker, in Python: the role UFO's in-process HostAgent plays.

For each step of a server-driven task that has no scripted steps, the session service sends a
PlanRequest on the NATS subject `<prefix>.planner.next` (request/reply) and waits for the
planner's decision (proto-schemas/schemas/PlanRequest.json and PlanReply.json):

    request: {"version": 1, "task_id", "task_name", "request", "data", "executor_id",
              "platform", "step", "last_results": [Result...]}
    reply:   {"ok": {"decision": "commands", "actions": [Command...]}}   send these to the device
             {"ok": {"decision": "complete", "result": ...}}             the task is done
             {"ok": {"decision": "fail", "error": "..."}}                 the task cannot be done

This planner echoes the task's request through the device's `echo` tool, then completes with
what came back. An LLM agent would decide the actions from `request` and `last_results` here.

The planner talks NATS, so the broker must be on NATS too. `aip dev` uses an in-process bus by
default, which nothing outside its process can reach: start it with --nats-url (or run the
distributed services):

    nats-server -js &
    aip dev --nats-url nats://127.0.0.1:4222
    python3 examples/python_planner.py --nats-url nats://127.0.0.1:4222
    aip device --id demo-pc --capability demo
    aip dispatch --capability demo "hello from the planner"      # no --tool/--step: planned

Needs: pip install nats-py   (see scripts/python-requirements.txt)
"""

import argparse
import asyncio
import json
import os
import signal

import nats


def decide(plan):
    """The next step of a task, from its PlanRequest."""
    if plan["step"] == 0:
        echo = {"tool_name": "echo", "tool_type": "action", "parameters": {"text": plan["request"]}}
        return {"decision": "commands", "actions": [echo]}
    failed = [r for r in plan["last_results"] if r["status"] != "success"]
    if failed:
        return {"decision": "fail", "error": f"the device failed: {failed[0].get('error')}"}
    return {"decision": "complete",
            "result": {"planner": "python", "echoed": plan["last_results"][0].get("result")}}


async def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--prefix", default="aip", help="the broker's subject prefix (aip dev --subject-prefix)")
    args = parser.parse_args()

    nc = await nats.connect(args.nats_url)

    async def on_plan(msg):
        plan = json.loads(msg.data)
        try:
            reply = {"ok": decide(plan)}
        except Exception as error:  # tell the broker instead of letting it time out
            reply = {"error": {"detail": f"planner failed: {error}", "error_code": "INTERNAL"}}
        print(f"task {plan['task_id']} step {plan['step']}: {json.dumps(reply)}", flush=True)
        await msg.respond(json.dumps(reply).encode())

    # A queue group: run several planners and each request goes to one of them.
    await nc.subscribe(f"{args.prefix}.planner.next", queue="planners", cb=on_plan)
    await nc.flush()
    print(f"planner ready on {args.prefix}.planner.next at {args.nats_url}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main())

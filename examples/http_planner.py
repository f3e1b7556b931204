#!/usr/bin/env python3
"""An HTTP planner for the aip broker, in a few lines of standard-library Python.

For each step of a task that has no steps of its own, the session service POSTs a PlanRequest
(proto-schemas/schemas/PlanRequest.json) to the planner's URL and reads a PlanReply:

    {"ok": {"decision": "commands", "actions": [Command...]}}   send these to the device
    {"ok": {"decision": "complete", "result": ...}}             the task is done
    {"ok": {"decision": "fail", "error": "..."}}                 the task cannot be done

This one types the task's request through the device's `echo` tool, then completes with what
came back. Works with the default `aip dev` (no NATS needed):

    python3 examples/http_planner.py --port 8700 &
    aip dev --planner-url http://127.0.0.1:8700/plan
    aip device --id demo-pc --capability demo
    aip dispatch --capability demo "hello from the HTTP planner"   # no --tool/--step: planned

With AIP_SESSIONS__PLANNER__SECRET=whsec_... set on the broker, the broker signs each request
(Standard Webhooks); give this planner the same secret with --secret (or AIP_PLANNER_SECRET) and
it refuses unsigned or forged requests (needs: pip install standardwebhooks).
"""

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def decide(plan):
    """The next step of a task, from its PlanRequest."""
    if plan["step"] == 0:
        echo = {"tool_name": "echo", "tool_type": "action", "parameters": {"text": plan["request"]}}
        return {"decision": "commands", "actions": [echo]}
    failed = [r for r in plan["last_results"] if r["status"] != "success"]
    if failed:
        return {"decision": "fail", "error": f"the device failed: {failed[0].get('error')}"}
    return {"decision": "complete",
            "result": {"planner": "python-http", "echoed": plan["last_results"][0].get("result")}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700, help="0: any free port")
    parser.add_argument("--secret", default=os.environ.get("AIP_PLANNER_SECRET"),
                        help="the broker's AIP_SESSIONS__PLANNER__SECRET (whsec_...)")
    args = parser.parse_args()
    verifier = None
    if args.secret:
        from standardwebhooks.webhooks import Webhook
        verifier = Webhook(args.secret)

    class Planner(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if verifier is not None:
                try:
                    verifier.verify(body, {k.lower(): v for k, v in self.headers.items()})
                except Exception as error:  # a forged, stale or unsigned request
                    return self.answer(401, {"error": {"detail": f"bad signature: {error}",
                                                       "error_code": "UNAUTHORIZED"}})
            plan = json.loads(body)
            try:
                reply = {"ok": decide(plan)}
            except Exception as error:  # tell the broker instead of letting it time out
                reply = {"error": {"detail": f"planner failed: {error}", "error_code": "INTERNAL"}}
            print(f"task {plan['task_id']} step {plan['step']}: {json.dumps(reply)}", flush=True)
            self.answer(200, reply)

        def answer(self, status, reply):
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Planner)
    host, port = server.server_address[:2]
    print(f"planner ready on http://{host}:{port}/plan", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

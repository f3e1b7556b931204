"""docker-compose.yml, run natively (native.py), used as a UFO deployment is used: through
the one public origin only.

1. A UFO-format device and a Galaxy-format constellation on ws://origin/ws run a task.
2. UFO's REST API on the same origin: /api/health, /api/clients, /api/dispatch,
   /api/task_result/{name}; aip's /api/tasks; every path of both OpenAPI documents reaches
   the service that serves it, anything else gets the origin's 404.
3. The task's trace reaches the OTLP receiver standing in for Jaeger: spans of the gateway
   and of the session service, in one trace.
The cluster runs as `docker compose up --scale gateway=3` would: three gateways.

4. A rolling restart under load: every gateway, then the session leader, SIGTERMed one at a
   time (each started again before the next, as compose's restart policy and Kubernetes do)
   while devices and constellations run tasks through the origin and reconnect by
   themselves: no task is lost, none runs a command twice.
5. With no session replica ready, the origin answers 503 UNAVAILABLE in the API's error shape.

    python3 -m unittest discover -s deploy/tests -p 'test_compose.py' -v
"""

import asyncio
import json
import os
import re
import sys
import time
import unittest

import deployfiles as d
import native
from native import http, log, within

sys.path.insert(0, os.path.join(d.ROOT, "bench", "faults"))
import load  # noqa: E402  (closed-loop UFO clients that reconnect by themselves)

TERMINAL = ("completed", "failed", "canceled", "rejected")
# Load of the rolling restart: devices, and as many constellations.
DEVICES = 4
# As `docker compose up --scale gateway=3`: one gateway more than the file's two, which the
# load balancer finds by DNS with no change to its configuration.
SCALE = {"gateway": 3}


def wire_status(state):
    """The status of the task_end a requester gets for a task that ended in `state`."""
    return "completed" if state == "completed" else "failed"


def constellation_id(device):
    return f"galaxy-{device}@{device}"


async def one_task(url, device, run_id):
    """A device and a constellation on `url`; the constellation runs one two-step task on the
    device. Returns the record (tasks, commands the device received)."""
    record, stop = load.Record(), load.Stop()
    ready = asyncio.Event()
    t0 = time.monotonic()
    device_task = asyncio.ensure_future(load.device(record, stop, url, device, t0, ready))
    await asyncio.wait_for(ready.wait(), 30)
    await asyncio.wait_for(load.constellation(record, stop, url, constellation_id(device), device,
                                              run_id, t0, count=1), 60)
    stop.closing.set()
    await device_task
    return record


async def dispatchable_device(url, device, registered, stop):
    """A UFO device as UFO's client behaves for `POST /api/dispatch`: it echoes the server's
    `task` frame as a client `task` (request, task name, platform), then answers every
    command. Returns the number of commands it ran."""
    import websockets
    commands = 0
    async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
        refusal = await load.register(ws, load.device_register(device))
        assert refusal is None, refusal
        registered.set()
        closing = asyncio.ensure_future(stop.wait())
        while True:
            recv = asyncio.ensure_future(ws.recv())
            done, _ = await asyncio.wait({recv, closing}, return_when=asyncio.FIRST_COMPLETED)
            if closing in done:
                recv.cancel()
                return commands
            frame = json.loads(recv.result())
            if frame.get("type") == "task":
                await ws.send(load.client_frame("task", "continue", "device", device,
                                                request=frame.get("user_request"),
                                                task_name=frame.get("task_name"),
                                                metadata={"platform": "linux"}))
            elif frame.get("type") == "command":
                commands += 1
                await ws.send(load.command_results(device, frame, f"{device}-r{commands}"))


class ThroughThePublicOrigin(unittest.TestCase):
    cluster = None

    @classmethod
    def setUpClass(cls):
        cls.cluster = native.Cluster(scale=SCALE)
        cls.origin = cls.cluster.public_url()
        cls.ws = cls.cluster.public_url("ws") + "/ws"
        # tearDownClass does not run when this fails: stop what was started here.
        try:
            cls.cluster.start()
            within(30, lambda: http("GET", f"{cls.origin}/api/tasks?limit=1")[0] == 200,
                   "REST through the origin")
        except BaseException:
            cls.cluster.stop()
            log(f"logs kept in {cls.cluster.logs}")
            raise

    failures = 0

    def run(self, result=None):
        result = super().run(result)
        if result is not None:
            type(self).failures = len(result.failures) + len(result.errors)
        return result

    @classmethod
    def tearDownClass(cls):
        if cls.cluster:
            cls.cluster.stop()
            panics = cls.cluster.panics()
            if panics:
                raise AssertionError(f"panics in {panics} ({cls.cluster.logs})")
            if cls.failures == 0:
                cls.cluster.remove()
            else:
                log(f"logs kept in {cls.cluster.logs}")

    # --- 1 ----------------------------------------------------------------------------
    def test_1_a_ufo_device_and_a_galaxy_constellation_run_a_task(self):
        run_id = f"r{int(time.time())}"
        record = asyncio.run(one_task(self.ws, "pc-origin", run_id))
        [(session_id, task)] = record.tasks.items()
        self.assertEqual(task.end_status, "completed", (task.end_error, task.errors))
        self.assertEqual(len(record.commands_by_response), load.STEPS, "one command per step")
        self.assertEqual(record.twice(), (0, 0))
        type(self).traced_session = session_id

    # --- 2 ----------------------------------------------------------------------------
    def test_2_ufo_rest_api_on_the_same_origin(self):
        status, body = http("GET", f"{self.origin}/api/health")
        self.assertEqual(status, 200, body)

        async def scenario():
            registered, stop = asyncio.Event(), asyncio.Event()
            device = asyncio.ensure_future(dispatchable_device(self.ws, "pc-rest", registered, stop))
            await asyncio.wait_for(registered.wait(), 30)
            try:
                await asyncio.to_thread(self.rest_tasks, "pc-rest")
            finally:
                stop.set()
                commands = await device
            # Two steps for the dispatched task, two for the REST task.
            self.assertEqual(commands, 2 * load.STEPS)

        asyncio.run(scenario())

    def rest_tasks(self, device):
        status, body = http("GET", f"{self.origin}/api/clients")
        self.assertEqual(status, 200, body)
        self.assertIn(device, json.loads(body)["online_clients"])
        # UFO's dispatch and result lookup.
        name = f"rest-{int(time.time() * 1000)}"
        status, body = http("POST", f"{self.origin}/api/dispatch", {
            "client_id": device, "request": "echo through the origin", "task_name": name,
            "steps": load.echo_steps()})
        self.assertEqual(status, 200, body)
        self.assertEqual(json.loads(body)["status"], "dispatched")

        def result():
            status, body = http("GET", f"{self.origin}/api/task_result/{name}")
            return status == 200 and json.loads(body).get("status") == "done" and json.loads(body)
        done = within(60, result, "the dispatched task's result")
        self.assertEqual(done["state"], "completed", done)
        # aip's task API.
        status, body = http("POST", f"{self.origin}/api/tasks", {
            "version": 1, "description": "aip task through the origin", "originating_agent_id": "deploy-test",
            "target_id": device, "steps": load.echo_steps()})
        self.assertEqual(status, 201, body)
        task_id = json.loads(body)["task_id"]

        def state():
            status, body = http("GET", f"{self.origin}/api/tasks/{task_id}")
            return status == 200 and json.loads(body)["state"] in TERMINAL and json.loads(body)["state"]
        self.assertEqual(within(60, state, "the REST task's end"), "completed")

    def test_2_every_rest_path_reaches_the_service_that_serves_it(self):
        """GET of every OpenAPI path through the origin answers as the owning service does
        when asked directly (a 405 for a POST-only path is the service's, not the origin's
        404), and a path no service has gets the origin's own 404."""
        leader = within(30, self.cluster.leader, "a session leader")
        direct = {"registry": f"http://{self.cluster.address('registry')}:5001",
                  "sessions": f"http://{leader.address}:5002"}
        for service, base in direct.items():
            with open(os.path.join(d.ROOT, "services", service, "openapi.json")) as f:
                paths = [p for p in json.load(f)["paths"] if p.startswith("/api/")]
            for path in paths:
                concrete = re.sub(r"\{[^}]+\}", "x1", path)
                through, body = http("GET", self.origin + concrete)
                expected, expected_body = http("GET", base + concrete)
                self.assertEqual(through, expected, f"{path}: {body[:200]} / directly {expected_body[:200]}")
                self.assertNotIn(b"no such path on this origin", body, path)
        for path in ("/", "/api/nope", "/api/agentsx", "/metrics", "/readyz"):
            status, body = http("GET", self.origin + path)
            self.assertEqual(status, 404, path)
            self.assertEqual(json.loads(body)["error_code"], "NOT_FOUND", path)

    # --- 3 ----------------------------------------------------------------------------
    def test_3_the_task_trace_reaches_the_otlp_receiver_across_processes(self):
        session_id = getattr(type(self), "traced_session", None)
        if session_id is None:
            self.skipTest("test_1 ran no task")

        def services_in_trace():
            spans = self.cluster.otlp.snapshot()
            traces = {t for (_, _, t, attributes) in spans if attributes.get("aip.session_id") == session_id}
            for trace in traces:
                services = {s for (s, _, t, _) in spans if t == trace}
                if {"aip-gateway", "aip-sessions"} <= services:
                    return services
            return None
        # The exporter sends every 5 s (OTEL_BSP_SCHEDULE_DELAY's default).
        services = within(30, services_in_trace, f"one trace of task {session_id} from gateway and sessions", 0.5)
        self.assertIn("aip-registry", services, "the registry's lookup is in the trace too")

    # --- 4 ----------------------------------------------------------------------------
    def test_4_rolling_restart_under_load_loses_no_task_and_runs_no_command_twice(self):
        result = asyncio.run(self.rolling_restart())
        log(json.dumps({k: v for k, v in result.items() if k != "record"}, default=str)[:2000])
        record = result["record"]
        self.assertGreater(result["completed_during_restarts"], 0, "tasks ran while replicas restarted")
        self.assertEqual(len(result["clients_moved_by"]), SCALE["gateway"], "every gateway was restarted")
        for gateway, clients in result["clients_moved_by"].items():
            self.assertGreater(clients, 0, f"stopping {gateway} moved none of the clients")
        self.assertEqual(result["no_task_end"], [], "a task whose requester stayed connected got no task_end")
        self.assertEqual(result["non_terminal"], [], "tasks left unfinished in the database")
        self.assertEqual(result["contradictions"], [], "requesters told something the database does not say")
        self.assertEqual(record.twice(), (0, 0), "a command ran twice")
        self.assertEqual(result["exit_codes"], {k: 0 for k in result["exit_codes"]},
                         "every SIGTERMed replica stopped cleanly")
        self.assertEqual(result["afterwards"], "completed", "a fresh task through the origin")

    async def rolling_restart(self):
        cluster = self.cluster
        record, stop = load.Record(), load.Stop()
        run_id = f"roll{int(time.time())}"
        t0 = time.monotonic()
        clients, readies = [], []
        for i in range(DEVICES):
            ready = asyncio.Event()
            readies.append(ready)
            clients.append(asyncio.ensure_future(load.device(record, stop, self.ws, f"roll-dev{i}", t0, ready)))
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 30)
        readies = []
        for i in range(DEVICES):
            ready = asyncio.Event()
            readies.append(ready)
            clients.append(asyncio.ensure_future(load.constellation(
                record, stop, self.ws, constellation_id(f"roll-dev{i}"), f"roll-dev{i}", run_id, t0, ready=ready)))
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 30)

        def completed():
            return sum(1 for t in record.tasks.values() if t.end_status == "completed")

        async def until(condition, secs, what):
            deadline = native.Deadline(secs)
            while not condition():
                if deadline.passed():
                    raise AssertionError(f"not within {secs}s: {what}")
                await asyncio.sleep(0.2)

        async def progress(what):
            """Tasks complete again (through the origin) after a restart."""
            before = completed()
            await until(lambda: completed() >= before + DEVICES, 60, f"tasks completing after {what}")

        await progress("the start")
        start_count = completed()
        exit_codes = {}
        order = [p for p in cluster.replicas_of("gateway")]
        moved = {}
        for proc in order:
            log(f"SIGTERM {proc.label}")
            before = record.reconnects
            exit_codes[proc.label] = await asyncio.to_thread(proc.terminate)
            fresh = cluster.restart(proc)
            await asyncio.to_thread(within, 60, lambda: cluster.healthy(fresh), f"{fresh.label} healthy again")
            await progress(f"restarting {proc.label}")
            moved[proc.label] = record.reconnects - before
        leader = await asyncio.to_thread(within, 30, cluster.leader, "a session leader")
        log(f"SIGTERM the session leader {leader.label}")
        exit_codes[f"{leader.label} (leader)"] = await asyncio.to_thread(leader.terminate)
        await asyncio.to_thread(within, 30, cluster.leader, "a new session leader")
        fresh = cluster.restart(leader)
        await asyncio.to_thread(within, 60, lambda: cluster.healthy(fresh), f"{fresh.label} healthy again")
        await progress(f"stopping the leader {leader.label}")
        completed_during = completed() - start_count

        # Settle: no new tasks; every task whose requester stayed connected gets its end.
        stop.submitting = False

        def open_tasks():
            return [sid for sid, t in record.tasks.items() if t.end_status is None and not t.socket_lost]
        try:
            await until(lambda: not open_tasks(), 60, "every task's task_end")
        except AssertionError:
            pass  # reported below, with the database's view

        def non_terminal():
            return cluster.psql("SELECT task_id, state FROM tasks WHERE state NOT IN "
                                f"({','.join(repr(s) for s in TERMINAL)}) AND task_id LIKE '%@{run_id}'")
        try:
            await until(lambda: not non_terminal(), 60, "every task terminal in the database")
        except AssertionError:
            pass
        db_states = dict(cluster.psql(f"SELECT task_id, state FROM tasks WHERE task_id LIKE '%@{run_id}'"))
        # A task_end says `completed` or `failed` (UFO's statuses): failed, canceled and
        # rejected tasks all end `failed` on the wire.
        contradictions = [(sid, t.end_status, db_states.get(sid)) for sid, t in record.tasks.items()
                          if t.end_status is not None and sid in db_states
                          and wire_status(db_states[sid]) != t.end_status]
        refused_unstored = [sid for sid, t in record.tasks.items()
                            if t.end_status is not None and t.end_status != "failed" and sid not in db_states]
        contradictions += [(sid, "completed", None) for sid in refused_unstored]
        afterwards = await asyncio.to_thread(self.fresh_task_state)
        result = {
            "submitted": len(record.tasks), "completed": completed(),
            "completed_during_restarts": completed_during,
            "ended_otherwise": sorted({(t.end_status, (t.end_error or "")[:80]) for t in record.tasks.values()
                                       if t.end_status not in (None, "completed")}),
            "no_task_end": open_tasks(), "non_terminal": non_terminal(),
            "contradictions": contradictions, "exit_codes": exit_codes, "afterwards": afterwards,
            "reconnects": record.reconnects, "clients_moved_by": moved, "record": record,
        }
        stop.closing.set()
        await asyncio.gather(*clients, return_exceptions=True)
        return result

    # --- 5 ----------------------------------------------------------------------------
    def test_5_with_no_session_replica_the_origin_answers_unavailable_in_the_api_shape(self):
        replicas = [p for p in self.cluster.replicas_of("sessions") if p.alive()]
        for proc in replicas:
            self.assertEqual(proc.terminate(), 0, proc.label)

        def refused():
            status, body = http("GET", f"{self.origin}/api/tasks")
            return status == 503 and json.loads(body)
        body = within(10, refused, "the origin noticing no session replica is ready")
        self.assertEqual(body["error_code"], "UNAVAILABLE", body)
        for proc in replicas:
            self.cluster.restart(proc)
        within(60, self.cluster.leader, "a session leader again")
        within(30, lambda: http("GET", f"{self.origin}/api/tasks")[0] == 200, "REST through the origin again")

    def fresh_task_state(self):
        """A task over REST on a load device once UFO's client list shows it, as a caller
        does it: a 503 UNAVAILABLE (a standby answered in the second before the load balancer
        saw the new leader, or no replica was ready yet) is tried again."""
        def online():
            status, body = http("GET", f"{self.origin}/api/clients")
            return status == 200 and "roll-dev0" in json.loads(body)["online_clients"]
        within(30, online, "roll-dev0 online in /api/clients")

        def submitted():
            status, body = http("POST", f"{self.origin}/api/tasks", {
                "version": 1, "description": "after the rolling restart", "originating_agent_id": "deploy-test",
                "target_id": "roll-dev0", "steps": load.echo_steps()})
            if status == 503 and json.loads(body)["error_code"] == "UNAVAILABLE":
                return None
            return status, body
        status, body = within(30, submitted, "a leader taking the REST task", 0.5)
        if status != 201:
            return f"refused: {status} {body[:200]}"
        task_id = json.loads(body)["task_id"]

        def state():
            status, body = http("GET", f"{self.origin}/api/tasks/{task_id}")
            return status == 200 and json.loads(body)["state"] in TERMINAL and json.loads(body)["state"]
        return within(60, state, "the fresh task's end")


if __name__ == "__main__":
    unittest.main()

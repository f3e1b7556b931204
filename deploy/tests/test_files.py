"""The deployment files against the real binaries and against each other, without running a
cluster: every command, flag and variable of docker-compose.yml and deploy/k8s is accepted by
the binary it is given to (`--check`), the load balancer's and NATS' configurations load, the
public origin routes every REST path of the OpenAPI documents to the service that serves it,
and the shutdown timings fit inside the grace periods.

    python3 -m unittest discover -s deploy/tests -p 'test_files.py' -v
"""

import json
import os
import re
import subprocess
import tempfile
import unittest

import deployfiles as d

# A gateway pings every client this often (gateway.ping_interval_ms' default).
PING_INTERVAL_SECS = 20
# What the services take to stop after SIGTERM unless configured otherwise (shutdown_grace_ms).
DEFAULT_SHUTDOWN_GRACE_SECS = 10


def check(argv, env):
    """Runs `argv --check` with exactly `env` and returns (exit code, output)."""
    result = subprocess.run([d.binary(argv[0]), *argv[1:], "--check"], env=env,
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


def listed_variables(output):
    """The variables `--check` says the binary reads (its lines `  NAME: meaning`)."""
    return {m.group(1) for m in re.finditer(r"^  ([A-Za-z_][A-Za-z0-9_]*): ", output, re.M)}


def openapi_paths(service):
    with open(os.path.join(d.ROOT, "services", service, "openapi.json")) as f:
        return [p for p in json.load(f)["paths"] if p.startswith("/api/")]


def concrete(path):
    """An OpenAPI path with every `{parameter}` filled in."""
    return re.sub(r"\{[^}]+\}", "x1", path)


class Commands(unittest.TestCase):
    """Each aip container's commands (its own, its health check's) checked by the binary."""

    def assert_accepted(self, where, argv, env):
        self.assertIn(argv[0], d.AIP_BINARIES, f"{where}: {argv} does not run an aip binary")
        code, output = check(argv, env)
        self.assertEqual(code, 0, f"{where}: `{' '.join(argv)} --check` refused it:\n{output}")
        missing = set(env) - listed_variables(output)
        self.assertFalse(missing, f"{where}: the binary does not read {sorted(missing)}:\n{output}")

    def test_compose_commands_flags_and_variables_are_the_binaries(self):
        checked = 0
        for name, service in d.compose()["services"].items():
            if service.get("image") != d.AIP_IMAGE:
                continue
            env = d.environment_of(service)
            self.assertIn("command", service, f"{name}: names no binary")
            self.assert_accepted(name, d.argv(service["command"]), env)
            checked += 1
            test = (service.get("healthcheck") or {}).get("test")
            if test:
                self.assertEqual(test[0], "CMD", f"{name}: health check {test} (exec form expected)")
                self.assert_accepted(f"{name} health check", test[1:], env)
                checked += 1
        self.assertGreaterEqual(checked, 7, "migrate, registry, sessions and gateway with checks")

    def test_kubernetes_commands_flags_and_variables_are_the_binaries(self):
        checked = 0
        for workload, container, spec in d.k8s_containers():
            if not container["image"].startswith("aip:"):
                continue
            where = f"{workload}/{container['name']}"
            env = d.k8s_container_environment(container)
            # The files the container's mounts show, written out; variables naming them point
            # at the copies (the binary reads them: a credentials file must parse).
            with tempfile.TemporaryDirectory() as tmp:
                for path, content in d.k8s_container_files(container, spec).items():
                    local = os.path.join(tmp, path.lstrip("/"))
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                    with open(local, "w") as f:
                        f.write(content)
                    env = {k: (local if v == path else v) for k, v in env.items()}
                for key in ("AIP_GATEWAY__CREDENTIALS_FILE", "AIP_SESSIONS__PRINCIPALS_FILE"):
                    if key in env:
                        self.assertTrue(env[key].startswith(tmp), f"{where}: {key} names no mounted file")
                self.assert_accepted(where, container["command"] + container.get("args", []), env)
            checked += 1
        self.assertGreaterEqual(checked, 5, "registry, sessions, gateway and the migrations")

    def test_a_misspelt_variable_is_refused_with_the_right_name(self):
        code, output = check(["aip-gateway"], {"AIP_GATEWAY__LISTNE": "0.0.0.0:5000"})
        self.assertNotEqual(code, 0, output)
        self.assertIn("did you mean AIP_GATEWAY__LISTEN?", output)
        code, output = check(["aip-registry"], {"AIP_GATEWAY__LISTEN": "0.0.0.0:5000"})
        self.assertNotEqual(code, 0, "a variable of another service is refused too")
        code, output = check(["aip-gateway", "migrate"], {})
        self.assertNotEqual(code, 0, "the gateway keeps no database")


class Probes(unittest.TestCase):
    """Ports, probes and the shutdown sequence of the manifests."""

    def test_probes_and_services_use_the_port_each_binary_listens_on(self):
        services = d.k8s_by_kind("Service")
        for workload, container, _ in d.k8s_containers():
            if not container["image"].startswith("aip:") or container["name"] == "migrate":
                continue
            env = d.k8s_container_environment(container)
            listen = [v for k, v in env.items() if k.endswith("__LISTEN")]
            self.assertEqual(len(listen), 1, f"{workload}: one listen address")
            port = int(listen[0].rsplit(":", 1)[1])
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            self.assertEqual(ports, {"http": port}, workload)
            for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                self.assertEqual(container[probe]["httpGet"], {"path": path, "port": "http"},
                                 f"{workload} {probe}")
            self.assertEqual(services[workload]["spec"]["ports"][0]["targetPort"], "http")

    def test_the_grace_period_outlasts_the_pre_stop_wait_and_the_drain(self):
        for name, deployment in d.k8s_by_kind("Deployment").items():
            spec = deployment["spec"]["template"]["spec"]
            container = spec["containers"][0]
            env = d.k8s_container_environment(container)
            grace_ms = [int(v) for k, v in env.items() if k.endswith("__SHUTDOWN_GRACE_MS")]
            drain = (grace_ms[0] / 1000) if grace_ms else DEFAULT_SHUTDOWN_GRACE_SECS
            pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
            self.assertEqual(pre_stop[0], "sleep", name)
            self.assertGreater(spec["terminationGracePeriodSeconds"], int(pre_stop[1]) + drain, name)

    def test_compose_waits_longer_than_the_drain(self):
        for name, service in d.compose()["services"].items():
            if service.get("image") == d.AIP_IMAGE and name != "migrate":
                self.assertIn("stop_grace_period", service, name)
                secs = int(service["stop_grace_period"].rstrip("s"))
                self.assertGreater(secs, DEFAULT_SHUTDOWN_GRACE_SECS, name)

    def test_migrations_run_before_every_service_with_a_database(self):
        services = d.compose()["services"]
        self.assertEqual(d.argv(services["migrate"]["command"])[1:], ["migrate"])
        for name, service in services.items():
            if name != "migrate" and "AIP_DATABASE_URL" in d.environment_of(service):
                self.assertEqual(service["depends_on"]["migrate"],
                                 {"condition": "service_completed_successfully"}, name)
        for name, deployment in d.k8s_by_kind("Deployment").items():
            spec = deployment["spec"]["template"]["spec"]
            if "AIP_DATABASE_URL" in d.k8s_container_environment(spec["containers"][0]):
                commands = [c["command"] for c in spec.get("initContainers", [])]
                self.assertTrue(any(c[1:] == ["migrate"] for c in commands), name)


class Routing(unittest.TestCase):
    """The Ingress routes like the compose load balancer (whose routing the native run
    checks request by request): every REST path to the service that serves it."""

    def owner(self, path):
        for service in ("registry", "sessions"):
            if any(re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", p), path) for p in openapi_paths(service)):
                return service
        return None

    def ingress_backend(self, path):
        """The Service the Ingress sends `path` to (Exact before Prefix, longest prefix first,
        prefixes matched by path element, as the Ingress API specifies)."""
        rules = d.k8s_by_kind("Ingress")["aip"]["spec"]["rules"]
        paths = [p for rule in rules for p in rule["http"]["paths"]]
        for p in paths:
            if p["pathType"] == "Exact" and p["path"] == path:
                return p["backend"]["service"]["name"]
        prefixes = sorted((p for p in paths if p["pathType"] == "Prefix"), key=lambda p: -len(p["path"]))
        for p in prefixes:
            if path == p["path"] or path.startswith(p["path"].rstrip("/") + "/"):
                return p["backend"]["service"]["name"]
        return None

    def test_every_rest_path_goes_to_its_service_and_ws_to_the_gateways(self):
        for service in ("registry", "sessions"):
            for path in openapi_paths(service):
                self.assertEqual(self.ingress_backend(concrete(path)), service, path)
        self.assertEqual(self.ingress_backend("/ws"), "gateway")
        for other in ("/", "/api", "/api/agentsx", "/metrics", "/readyz", "/ws/x"):
            self.assertIsNone(self.ingress_backend(other), other)

    def test_websocket_timeouts_outlast_the_ping_interval(self):
        annotations = d.k8s_by_kind("Ingress")["aip"]["metadata"]["annotations"]
        for key in ("proxy-read-timeout", "proxy-send-timeout"):
            self.assertGreater(int(annotations[f"nginx.ingress.kubernetes.io/{key}"]), PING_INTERVAL_SECS)
        with open(os.path.join(d.ROOT, "deploy", "haproxy", "haproxy.cfg")) as f:
            text = f.read()
        tunnel = re.search(r"^\s*timeout tunnel (\d+)s", text, re.M)
        self.assertGreater(int(tunnel.group(1)), PING_INTERVAL_SECS)


class Image(unittest.TestCase):
    """What the image is built from."""

    def context(self, into):
        """Copies the build context as .dockerignore leaves it (its rules: `*`, then `!path`
        to take a top-level path back, then exclusions of `**/name/`) into `into`."""
        import shutil
        with open(os.path.join(d.ROOT, ".dockerignore")) as f:
            rules = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        self.assertEqual(rules[0], "*", "an allow-list")
        taken = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
        dropped = [r[3:].rstrip("/") for r in rules if r.startswith("**/")]
        self.assertEqual(len(taken) + len(dropped) + 1, len(rules), f"rules this test reads: {rules}")
        ignore = shutil.ignore_patterns(*dropped)
        for path in taken:
            source = os.path.join(d.ROOT, path)
            if os.path.isdir(source):
                shutil.copytree(source, os.path.join(into, path), ignore=ignore)
            else:
                shutil.copy(source, os.path.join(into, path))

    def test_the_build_context_holds_the_whole_workspace(self):
        """`cargo metadata --locked --offline` (for Linux) in a copy of the context: every member,
        the lock file and what the crates include (the migrations) are in it."""
        with tempfile.TemporaryDirectory() as tmp:
            self.context(tmp)
            result = subprocess.run(["cargo", "metadata", "--locked", "--offline", "--format-version", "1",
                                     "--filter-platform", "x86_64-unknown-linux-gnu"],
                                    cwd=tmp, capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr[-2000:])
            packages = {p["name"] for p in json.loads(result.stdout)["packages"]}
            for package in ("aip-gateway", "aip-registry", "aip-sessions", "aip"):
                self.assertIn(package, packages)
            self.assertTrue(os.path.isdir(os.path.join(tmp, "migrations", "postgres")))
            self.assertTrue(os.path.isfile(os.path.join(tmp, ".cargo", "config.toml")))
            self.assertFalse(os.path.exists(os.path.join(tmp, "target")))

    def test_the_dockerfile_builds_and_ships_every_binary(self):
        with open(os.path.join(d.ROOT, "deploy", "Dockerfile")) as f:
            text = f.read()
        for binary in d.AIP_BINARIES:
            self.assertRegex(text, rf"-p {re.escape(binary)}(?![\w-])", "built")
            self.assertRegex(text, rf"target/release/{re.escape(binary)}(?![\w-])", "shipped")
        self.assertRegex(text, r"(?m)^USER 10001:10001$", "a non-root user, numeric for runAsNonRoot")

    def test_scaled_services_have_no_fixed_name_or_host_port(self):
        """`docker compose up --scale gateway=N`: a fixed container name or host port would
        clash between replicas."""
        for name, service in d.compose()["services"].items():
            if name in ("gateway", "sessions", "registry"):
                self.assertNotIn("container_name", service, name)
                self.assertNotIn("ports", service, name)


class Configurations(unittest.TestCase):
    """The configuration files of the other programs load with compose's environment."""

    def test_haproxy_loads_its_configuration(self):
        lb = d.compose()["services"]["lb"]
        config = os.path.join(d.ROOT, "deploy", "haproxy", "haproxy.cfg")
        self.assertIn("./deploy/haproxy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro", lb["volumes"])
        result = subprocess.run([d.program("haproxy"), "-c", "-f", config], env=d.environment_of(lb),
                                capture_output=True, text=True, timeout=30)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertNotIn("WARNING", result.stdout + result.stderr)

    def test_nats_loads_its_configuration_with_every_user(self):
        nats = d.compose()["services"]["nats"]
        argv = d.argv(nats["command"])
        self.assertEqual(argv[:2], ["nats-server", "--config"])
        self.assertIn("./deploy/nats:/etc/nats/aip:ro", nats["volumes"])
        config = argv[2].replace("/etc/nats/aip", os.path.join(d.ROOT, "deploy", "nats"))
        result = subprocess.run([d.program("nats-server"), "--config", config, "-t"], env=d.environment_of(nats),
                                capture_output=True, text=True, timeout=30)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        # Every password users.conf reads is given (an unset one would be an empty password).
        with open(os.path.join(d.ROOT, "deploy", "nats", "users.conf")) as f:
            wanted = set(re.findall(r"\$(AIP_NATS_[A-Z_]+_PASSWORD)", f.read()))
        self.assertEqual(wanted, set(d.environment_of(nats)))
        container = d.k8s_by_kind("StatefulSet")["nats"]["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(wanted, {e["name"] for e in container["env"]})
        # The same command and the same files (test below): this check covers Kubernetes too.
        self.assertEqual(container["command"], argv)
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        self.assertIn("/etc/nats/aip", mounts)

    def test_the_kubernetes_nats_configuration_is_deploy_nats(self):
        data = d.k8s_by_kind("ConfigMap")["nats-config"]["data"]
        for name in ("nats-server.conf", "users.conf", "permissions.conf"):
            with open(os.path.join(d.ROOT, "deploy", "nats", name)) as f:
                self.assertEqual(data[name], f.read(), f"deploy/k8s/nats.yaml differs from deploy/nats/{name}")

    def test_the_kustomization_lists_every_manifest(self):
        import yaml
        with open(os.path.join(d.K8S_DIR, "kustomization.yaml")) as f:
            listed = set(yaml.safe_load(f)["resources"])
        self.assertEqual(listed, {os.path.basename(p) for p in d.k8s_files()})

    def test_every_service_passes_its_user_to_nats(self):
        for name, service in d.compose()["services"].items():
            env = d.environment_of(service)
            if service.get("image") == d.AIP_IMAGE and "AIP_NATS_URL" in env:
                self.assertEqual(env.get("AIP_NATS_USER"), f"aip-{name}", name)


if __name__ == "__main__":
    unittest.main()

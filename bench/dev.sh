#!/usr/bin/env bash
# Benchmarks the embedded mode: starts the release `aip dev` (in-process bus, SQLite in a
# temporary data directory) on a free port with the per-connection frame limit off, runs
# bench/matrix.sh against it, and stops it.
#
# Results: bench/results/dev/ (bench/results-quick/dev/ with BENCH_QUICK=1).
# Environment: see bench/matrix.sh (BENCH_QUICK, BENCH_SECONDS, BENCH_CLIENTS,
# BENCH_SCENARIOS, ...), AIP_BIN_DIR, BENCH_RESULTS_DIR, BENCH_RUST_LOG (default info).
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_init
require_bins aip

MODE=dev
DIR="$(prepare_mode_dir "$MODE")"
make_tmpdir
DATA="$BENCH_TMPDIR"
PORT="$(free_port)"
record_machine "$DIR"

BROKER_CMD=(env AIP_GATEWAY__FRAMES_PER_SECOND=0 AIP_GATEWAY__SHUTDOWN_GRACE_MS=3000
  RUST_LOG="${BENCH_RUST_LOG:-info}"
  "$(bin aip)" dev --listen "127.0.0.1:$PORT" --data-dir "$DATA")
start_proc "aip dev" "$DIR/logs/aip-dev.log" "${BROKER_CMD[@]}"
DEV_PID=$STARTED_PID
wait_ready "http://127.0.0.1:$PORT/readyz" "$DEV_PID" "aip dev" "$DIR/logs/aip-dev.log"

python3 - "$DIR/run.json" "$MODE" "$(json_array "${BROKER_CMD[@]}")" <<'PY'
import json, sys
out, mode, cmd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
json.dump({"mode": mode, "gateways": 1,
           "description": "embedded: aip dev (gateway, registry and sessions in one process, "
                          "in-process bus, SQLite in a temporary directory)",
           "broker_commands": [cmd]}, open(out, "w"), indent=2)
PY

run_tracked "bench/matrix.sh ($MODE)" "$BENCH_DIR/matrix.sh" --mode "$MODE" --dir "$DIR" \
  --url "ws://127.0.0.1:$PORT/ws" --rest "http://127.0.0.1:$PORT" --pid "$DEV_PID"
log "$MODE: done; results in $DIR"

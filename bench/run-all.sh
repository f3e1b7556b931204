#!/usr/bin/env bash
# Runs the whole benchmark on this machine: the embedded mode (bench/dev.sh), then the
# distributed mode with 1 and with 2 gateways (bench/distributed.sh), then writes
# bench/results/summary.md with bench/report.py. Builds nothing: build the release
# binaries first (cargo build --release -p aip -p aip-gateway -p aip-registry -p aip-sessions).
#
# Usage: bench/run-all.sh [dev] [distributed-1gw] [distributed-2gw]   (default: all three)
# Environment: see bench/matrix.sh (BENCH_QUICK=1 for a smoke test, BENCH_SECONDS, ...).
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_init
require_bins aip aip-gateway aip-registry aip-sessions

MODES=("$@")
if ((${#MODES[@]} == 0)); then MODES=(dev distributed-1gw distributed-2gw); fi

STATUS=0
for mode in "${MODES[@]}"; do
  case "$mode" in
    dev) cmd=("$BENCH_DIR/dev.sh") ;;
    distributed-1gw) cmd=("$BENCH_DIR/distributed.sh" --gateways 1) ;;
    distributed-2gw) cmd=("$BENCH_DIR/distributed.sh" --gateways 2) ;;
    *) die "unknown mode '$mode' (expected dev, distributed-1gw, distributed-2gw)" ;;
  esac
  log "=== $mode ==="
  if ! run_tracked "$mode" "${cmd[@]}"; then
    warn "$mode failed (see above and $BENCH_RESULTS_DIR/$mode/logs); going on"
    STATUS=1
  fi
done

mkdir -p "$BENCH_RESULTS_DIR"
python3 "$BENCH_DIR/report.py" --results "$BENCH_RESULTS_DIR" >"$BENCH_RESULTS_DIR/summary.md"
log "summary: $BENCH_RESULTS_DIR/summary.md"
exit "$STATUS"

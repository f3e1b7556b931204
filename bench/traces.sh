#!/usr/bin/env bash
# The cost of tracing on the task path (issue 18): runs bench/distributed.sh (tasks, 1 and 100
# clients) with traces off, on (every span exported) and sampled at 10 %, alternating, ROUNDS
# times. Spans go to bench/otlp_sink.py (pip install grpcio), an OTLP/gRPC endpoint that accepts
# without decoding. Needs the release binaries (AIP_BIN_DIR, default target/release).
#
# Usage: bench/traces.sh [OUT_DIR]   (default bench/results/traces-<date>; ROUNDS=2, SINK_PORT=4319)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${1:-bench/results/traces-$(date -u +%Y%m%d)}"
ROUNDS="${ROUNDS:-2}"
PORT="${SINK_PORT:-4319}"
export AIP_BIN_DIR="${AIP_BIN_DIR:-target/release}" BENCH_SCENARIOS=tasks BENCH_CLIENTS="1 100"
mkdir -p "$OUT"
run() { # mode, round, extra environment...
  local mode="$1" round="$2"; shift 2
  local sink=""
  if [[ "$mode" != off ]]; then
    python3 bench/otlp_sink.py --port "$PORT" > "$OUT/sink-$mode-$round.log" 2>&1 &
    sink=$!
    sleep 1
  fi
  env "$@" BENCH_RESULTS_DIR="$OUT/$mode-$round" bench/distributed.sh > "$OUT/$mode-$round.log" 2>&1
  if [[ -n "$sink" ]]; then kill -TERM "$sink"; wait "$sink" || true; fi
  echo "traces.sh: $mode, round $round: $OUT/$mode-$round"
}
for round in $(seq 1 "$ROUNDS"); do
  run off "$round"
  run on "$round" "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$PORT"
  run sampled "$round" "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$PORT" \
    OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.1
done

#!/usr/bin/env bash
# The soak (issue 14): the distributed broker under a steady task load for a long time, on
# this machine's NATS and PostgreSQL (or, with --own-postgres, a throwaway PostgreSQL cluster
# with the server's default settings), with every process's RSS sampled.
#
# Starts the release aip-registry, aip-sessions and one aip-gateway on a fresh database and
# subject prefix (as bench/distributed.sh does), finds the closed-loop peak of
# `aip bench tasks` (K = 1) with 100 constellations, picks the number of constellations whose
# rate is closest to half of it, then runs `aip bench tasks` with that many in back-to-back
# windows of WINDOW seconds until DURATION seconds have passed. Every 10 s it samples the RSS
# and CPU time of each broker process. At the end bench/soak_report.py writes the table, the
# verdict (RSS flat within 10 %, latency percentiles stable) and a plot.
#
# Usage: bench/soak.sh [--duration SECS] [--window SECS] [--own-postgres]
#        (defaults 3600 and 60). --own-postgres (root): `initdb` a cluster in a temporary
#        directory, as PostgreSQL ships it (autovacuum on, fsync on), reached over its Unix
#        socket. Use it where the machine's server runs without autovacuum (this machine's CI
#        configuration does): without ANALYZE, plans cached while the tables were empty
#        scan the whole tasks table, and the rate falls by half within ten minutes.
# Results: bench/results/soak-<time>/ (windows.jsonl, rss.jsonl, soak.md, soak.png, logs/).
# Needs: cargo build --release -p aip -p aip-gateway -p aip-registry -p aip-sessions;
#        python3 with matplotlib for the plot (pip install matplotlib).
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DURATION=3600
WINDOW=60
OWN_POSTGRES=0
while (($#)); do
  case "$1" in
    --duration) DURATION="${2:-}"; shift 2 ;;
    --window) WINDOW="${2:-}"; shift 2 ;;
    --own-postgres) OWN_POSTGRES=1; shift ;;
    -h | --help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ "$DURATION" =~ ^[0-9]+$ && "$WINDOW" =~ ^[0-9]+$ && "$WINDOW" -ge 10 ]] ||
  { echo "soak.sh: --duration and --window are seconds (window at least 10)" >&2; exit 2; }

bench_init
require_bins aip aip-gateway aip-registry aip-sessions
DIR="$BENCH_RESULTS_DIR/soak-$(date +%Y%m%dT%H%M%S)"
mkdir -p "$DIR/logs"

if [[ "$OWN_POSTGRES" == 1 ]]; then start_own_postgres "$DIR/logs" socket; fi
check_infra
record_machine "$DIR" infra
pg_create_db soak
new_prefix
log "soak: database $BENCH_DB, subject prefix $BENCH_PREFIX, $DURATION s in windows of $WINDOW s"

COMMON=(env "AIP_NATS_URL=$BENCH_NATS_URL" "AIP_DATABASE_URL=$(pg_url "$BENCH_DB")"
  "AIP_SUBJECT_PREFIX=$BENCH_PREFIX" "RUST_LOG=${BENCH_RUST_LOG:-info}")
NAMES=()
PIDS=()

REGISTRY_PORT="$(free_port)"
start_proc aip-registry "$DIR/logs/aip-registry.log" "${COMMON[@]}" \
  "AIP_REGISTRY__LISTEN=127.0.0.1:$REGISTRY_PORT" "$(bin aip-registry)"
NAMES+=(aip-registry) PIDS+=("$STARTED_PID")
wait_ready "http://127.0.0.1:$REGISTRY_PORT/readyz" "$STARTED_PID" aip-registry "$DIR/logs/aip-registry.log"

SESSIONS_PORT="$(free_port)"
start_proc aip-sessions "$DIR/logs/aip-sessions.log" "${COMMON[@]}" \
  "AIP_SESSIONS__LISTEN=127.0.0.1:$SESSIONS_PORT" "$(bin aip-sessions)"
NAMES+=(aip-sessions) PIDS+=("$STARTED_PID")
wait_ready "http://127.0.0.1:$SESSIONS_PORT/readyz" "$STARTED_PID" aip-sessions "$DIR/logs/aip-sessions.log"

GATEWAY_PORT="$(free_port)"
start_proc aip-gateway "$DIR/logs/aip-gateway.log" "${COMMON[@]}" \
  "AIP_GATEWAY__LISTEN=127.0.0.1:$GATEWAY_PORT" "AIP_GATEWAY__GATEWAY_ID=$BENCH_PREFIX-gw" \
  AIP_GATEWAY__FRAMES_PER_SECOND=0 "$(bin aip-gateway)"
NAMES+=(aip-gateway) PIDS+=("$STARTED_PID")
wait_ready "http://127.0.0.1:$GATEWAY_PORT/readyz" "$STARTED_PID" aip-gateway "$DIR/logs/aip-gateway.log"

BENCH=("$(bin aip)" bench tasks --url "ws://127.0.0.1:$GATEWAY_PORT/ws"
  --rest "http://127.0.0.1:$SESSIONS_PORT" --json --quiet --no-verify --commands 1)

# One window: `aip bench tasks` with $1 constellations (and as many devices) for $2 seconds.
window() {
  "${BENCH[@]}" --clients "$1" --devices "$1" --count 100000000 --max-seconds "$2"
}

# Peak and the load at half of it.
log "calibrating: peak with 100 constellations"
peak="$(window 100 30 | python3 -c 'import json,sys; print(json.load(sys.stdin)["throughput_per_sec"])')"
half="$(python3 -c "print($peak / 2)")"
best_clients=1
best_gap=""
for clients in 2 4 8 16 32; do
  rate="$(window "$clients" 20 | python3 -c 'import json,sys; print(json.load(sys.stdin)["throughput_per_sec"])')"
  gap="$(python3 -c "print(abs($rate - $half))")"
  log "calibrating: $clients constellations: $rate tasks/s (half the peak: $half)"
  if [[ -z "$best_gap" ]] || python3 -c "import sys; sys.exit(0 if $gap < $best_gap else 1)"; then
    best_clients="$clients" best_gap="$gap"
  fi
done
AUTOVACUUM="$(psql_admin -tAc 'SHOW autovacuum')"
python3 - "$DIR/run.json" "$peak" "$best_clients" "$DURATION" "$WINDOW" "$AUTOVACUUM" \
  "$(pg_url "$BENCH_DB")" "${NAMES[@]}" <<'PY'
import json, sys
out, peak, clients, duration, window, autovacuum, url, *names = sys.argv[1:]
json.dump({"peak_tasks_per_sec": float(peak), "clients": int(clients),
           "duration_secs": int(duration), "window_secs": int(window), "processes": names,
           "postgres": {"url": url, "autovacuum": autovacuum}},
          open(out, "w"), indent=2)
PY
log "soak: $best_clients constellations (peak $peak tasks/s), for $DURATION s"

# RSS and CPU of every broker process every 10 s, until the soak ends.
sample() {
  local start="$1"
  while :; do
    python3 - "$start" "${NAMES[*]}" "${PIDS[@]}" <<'PY' >>"$DIR/rss.jsonl"
import json, os, sys, time
start, names, pids = float(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
row = {"t": round(time.time() - start, 1)}
tick = os.sysconf("SC_CLK_TCK")
for name, pid in zip(names, pids):
    try:
        rss = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        row[name] = {"rss_kib": rss, "cpu_secs": (int(fields[11]) + int(fields[12])) / tick}
    except (OSError, StopIteration):
        row[name] = None
print(json.dumps(row))
PY
    sleep 10
  done
}
START="$(date +%s.%N)"
sample "$START" &
SAMPLER=$!
BENCH_PIDS+=("$SAMPLER") BENCH_PID_NAMES+=(sampler)

end=$(python3 -c "print($START + $DURATION)")
n=0
while python3 -c "import sys,time; sys.exit(0 if time.time() < $end - 5 else 1)"; do
  n=$((n + 1))
  left="$(python3 -c "import time; print(max(10, min($WINDOW, int($end - time.time()))))")"
  if ! window "$best_clients" "$left" >"$DIR/window.json" 2>>"$DIR/logs/aip-bench.log"; then
    warn "window $n: aip bench failed (see $DIR/logs/aip-bench.log)"
  fi
  python3 - "$START" "$n" "$DIR/window.json" <<'PY' >>"$DIR/windows.jsonl"
import json, sys, time
start, n, path = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
try:
    report = json.load(open(path))
except (OSError, ValueError) as e:
    report = {"error": str(e)}
print(json.dumps({"window": n, "t_end": round(time.time() - start, 1), "report": report}))
PY
  for i in "${!PIDS[@]}"; do
    alive "${PIDS[$i]}" || die "${NAMES[$i]} exited during the soak; see $DIR/logs/"
  done
done
kill "$SAMPLER" 2>/dev/null || true
python3 "$BENCH_DIR/soak_report.py" "$DIR"
log "soak: done; results in $DIR (soak.md, soak.png)"

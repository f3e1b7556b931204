#!/usr/bin/env bash
# Runs every `aip bench` scenario against a broker that is already running, at 1, 10 and
# 100 clients, and saves each report as JSON:
#
#   DIR/<scenario>-<clients>.json     (connect: <clients> is the number of devices)
#   DIR/logs/<scenario>-<clients>.stderr
#
# Usage:
#   bench/matrix.sh --mode NAME --dir DIR --rest http://127.0.0.1:PORT \
#                   --url ws://127.0.0.1:PORT/ws [--url ws://127.0.0.1:PORT2/ws] \
#                   --pid PID [--pid PID...] [--infra-db DATABASE]
#
#   --url      a gateway (repeatable); every run is one `aip bench` process given every
#              --url: it spreads its clients over the gateways, and in devinfo and tasks
#              puts every constellation on another gateway than its device
#   --pid      a broker process (aip dev, or gateway/registry/sessions), sampled with
#              --server-pid; the run stops if one of them dies
#   --infra-db also sample nats-server and the PostgreSQL processes serving this database
#
# Environment:
#   BENCH_SECONDS    length of each time-bounded run (default 8): counts are set far above
#                    what the broker can do and --max-seconds ends the run
#   BENCH_CLIENTS    client counts (default "1 10 100")
#   BENCH_SCENARIOS  scenarios (default "connect heartbeat register devinfo tasks rest")
#   BENCH_CONNECT_N  devices of the connect runs (default "100 1000 10000")
#   BENCH_PAUSE      seconds of rest between runs (default 2)
#   BENCH_WARMUP     seconds of untimed tasks load before the first run (default 3; 0: none)
#   BENCH_QUICK=1    smoke test: tiny counts, connect with 20 and 200 devices, no warm-up
set -euo pipefail
# shellcheck source=bench/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

MODE="" DIR="" REST="" URLS=() PIDS=() INFRA_DB=""
while (($#)); do
  case "$1" in
    --mode) MODE="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    --rest) REST="$2"; shift 2 ;;
    --url) URLS+=("$2"); shift 2 ;;
    --pid) PIDS+=("$2"); shift 2 ;;
    --infra-db) INFRA_DB="$2"; shift 2 ;;
    -h | --help) usage ;;
    *) echo "matrix.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ -n "$MODE" && -n "$DIR" && -n "$REST" && ${#URLS[@]} -ge 1 && ${#PIDS[@]} -ge 1 ]] ||
  { echo "matrix.sh: --mode, --dir, --rest, --url and --pid are required" >&2; usage; }

bench_init
require_bins aip
AIP="$(bin aip)"
mkdir -p "$DIR/logs"
# connect with 10000 devices needs about 10,100 file descriptors in the generator.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

if [[ "$BENCH_QUICK" == 1 ]]; then
  SECS="${BENCH_SECONDS:-30}"   # only a safety bound: the tiny counts end the runs
  CONNECT_N="${BENCH_CONNECT_N:-20 200}"
  WARMUP="${BENCH_WARMUP:-0}"
else
  SECS="${BENCH_SECONDS:-8}"
  CONNECT_N="${BENCH_CONNECT_N:-100 1000 10000}"
  WARMUP="${BENCH_WARMUP:-3}"
fi
CLIENTS="${BENCH_CLIENTS:-1 10 100}"
SCENARIOS="${BENCH_SCENARIOS:-connect heartbeat register devinfo tasks rest}"
PAUSE="${BENCH_PAUSE:-2}"
for scenario in $SCENARIOS; do
  case "$scenario" in
    connect | heartbeat | register | devinfo | tasks | rest) ;;
    *) die "unknown scenario '$scenario' in BENCH_SCENARIOS (expected connect heartbeat register devinfo tasks rest)" ;;
  esac
done

# Operations of a whole run (all clients together). Full runs are time-bounded: these are
# ceilings far above the figures so far (and above the targets), so that --max-seconds ends
# the run, not the count. Quick runs: small fixed totals.
total_ops() {
  local scenario="$1"
  if [[ "$BENCH_QUICK" == 1 ]]; then
    case "$scenario" in
      heartbeat) echo 2000 ;; devinfo) echo 1000 ;; register) echo 100 ;;
      tasks) echo 100 ;; rest) echo 100 ;;
    esac
  else
    local rate
    case "$scenario" in
      heartbeat) rate=500000 ;; devinfo) rate=300000 ;; register) rate=50000 ;;
      tasks) rate=30000 ;; rest) rate=30000 ;;
    esac
    echo $((rate * SECS))
  fi
}

ceil_div() { echo $((($1 + $2 - 1) / $2)); }

# scenario_args SCENARIO CLIENTS: the scenario's arguments for a run with CLIENTS clients
# (connect: devices).
scenario_args() {
  local scenario="$1" c="$2" ops per_client hold
  case "$scenario" in
    connect)
      if [[ "$BENCH_QUICK" == 1 ]]; then hold=1
      elif ((c >= 10000)); then hold=10
      else hold=5; fi
      # One loopback source address per 20,000 devices: each has about 28,000 ephemeral ports.
      echo "connect --n $c --hold $hold --source-addresses $((c / 20000 + 1))"
      return
      ;;
  esac
  ops="$(total_ops "$scenario")"
  per_client="$(ceil_div "$ops" "$c")"
  case "$scenario" in
    heartbeat) echo "heartbeat --clients $c --count $per_client" ;;
    register) echo "register --clients $c --count $per_client" ;;
    devinfo) echo "devinfo --devices $c --clients $c --count $per_client" ;;
    tasks) echo "tasks --devices $c --clients $c --count $per_client --commands 1" ;;
    rest) echo "rest --devices $c --concurrency $c --count $((per_client * c)) --commands 1" ;;
    *) die "unknown scenario $scenario (expected connect heartbeat register devinfo tasks rest)" ;;
  esac
}

max_seconds() {
  case "$1" in
    connect) echo 180 ;;   # setup of up to 10,000 devices, then the hold
    *) echo "$SECS" ;;
  esac
}

# server_pids: the broker's pids, plus NATS and PostgreSQL with --infra-db, alive now.
server_pids() {
  local all=("${PIDS[@]}")
  if [[ -n "$INFRA_DB" ]]; then
    # shellcheck disable=SC2207
    all+=($(infra_pids "$INFRA_DB"))
  fi
  "${HELPERS[@]}" alive "${all[@]}"
}

check_broker() {
  local pid
  for pid in "${PIDS[@]}"; do
    alive "$pid" || die "broker process $pid is gone: stopping the matrix ($MODE)" \
      "see the logs in $DIR/logs"
  done
}

# URL_ARGS: --url for every gateway, as aip bench takes them.
URL_ARGS=()
for url in "${URLS[@]}"; do URL_ARGS+=(--url "$url"); done

# one_bench OUT ERR SCENARIO_ARGS...: the `aip bench` process of one run; retried once when
# a sampled process vanished between listing it and the start. Runs in a background
# subshell: SIGTERM (the cleanup of an interrupted run) stops the bench process too.
one_bench() {
  local out="$1" err="$2" attempt child status
  shift 2
  trap '[[ -n "${child:-}" ]] && kill -TERM "$child" 2>/dev/null; exit 143' TERM
  for attempt in 1 2; do
    local cmd=("$AIP" bench "$@" "${URL_ARGS[@]}" --rest "$REST" --json --quiet
      --max-seconds "$MAX_SECS" --verify-seconds 60)
    local pid
    for pid in $(server_pids); do cmd+=(--server-pid "$pid"); done
    json_array "${cmd[@]}" >"$out.cmd"
    "${cmd[@]}" >"$out" 2>"$err" &
    child=$!
    status=0
    wait "$child" || status=$?
    child=""
    if ((status == 0)); then
      return 0
    fi
    if [[ $attempt == 1 ]] && grep -q -- '--server-pid' "$err"; then
      warn "a sampled process vanished before the run started; retrying once"
      continue
    fi
    return 1
  done
}

FAILED=()

# run SCENARIO CLIENTS: one cell of the matrix. The report goes to logs/ first and becomes
# DIR/<scenario>-<clients>.json only if the run succeeded.
run() {
  local scenario="$1" clients="$2" name="$1-$2"
  MAX_SECS="$(max_seconds "$scenario")"
  check_broker
  local what="clients"
  if [[ $scenario == connect ]]; then what="devices"; fi
  if ((${#URLS[@]} > 1)); then what+=" over ${#URLS[@]} gateways"; fi
  log "$MODE: $scenario with $clients $what"
  local out="$DIR/logs/$name.out.json" err="$DIR/logs/$name.stderr" ok=1
  # shellcheck disable=SC2046
  one_bench "$out" "$err" $(scenario_args "$scenario" "$clients") &
  local pid=$!
  BENCH_PIDS+=("$pid")
  BENCH_PID_NAMES+=("aip bench $name")
  if ! wait "$pid"; then
    ok=0
    warn "$name: aip bench failed; the end of its stderr ($err):"
    tail -n 20 "$err" | sed 's/^/    /' >&2 || true
  fi
  # A broker that died during the run makes its figures meaningless.
  check_broker
  if ((ok)); then
    "${HELPERS[@]}" annotate "$out" --mode "$MODE" --gateways "${#URLS[@]}" \
      --label "$name" --command "$(cat "$out.cmd")"
    mv "$out" "$DIR/$name.json"
    python3 - "$DIR/$name.json" <<'EOF' >&2
import json, sys
r = json.load(open(sys.argv[1]))
lat = r["latencies"][0] if r["latencies"] else None
cpu = sum(p["cpu_percent"] for p in r["broker"])
print(f"    {r['completed']} {r['unit']} in {r['window_secs']:.1f} s: "
      f"{r['throughput_per_sec']:.0f}/s"
      + (f", p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms" if lat else "")
      + f", {r['failures']} failures, sampled processes {cpu:.0f}% CPU")
EOF
  else
    FAILED+=("$name")
  fi
  sleep "$PAUSE"
}

log "$MODE: results in $DIR"
if [[ "$WARMUP" != 0 ]]; then
  max_c=0
  for c in $CLIENTS; do
    if ((c > max_c)); then max_c=$c; fi
  done
  log "$MODE: warm-up (${WARMUP}s of tasks with $max_c clients, not recorded)"
  check_broker
  "$AIP" bench tasks --devices "$max_c" --clients "$max_c" --count 100000 --no-verify \
    "${URL_ARGS[@]}" --rest "$REST" --json --quiet --max-seconds "$WARMUP" \
    >"$DIR/logs/warmup.json" 2>"$DIR/logs/warmup.stderr" ||
    warn "the warm-up failed (see $DIR/logs/warmup.stderr); going on"
  sleep "$PAUSE"
fi

for scenario in $SCENARIOS; do
  if [[ "$scenario" == connect ]]; then
    for n in $CONNECT_N; do run connect "$n"; done
  else
    for c in $CLIENTS; do run "$scenario" "$c"; done
  fi
done

if ((${#FAILED[@]})); then
  printf '%s\n' "${FAILED[@]}" >"$DIR/failed-runs.txt"
  die "$MODE: ${#FAILED[@]} run(s) failed: ${FAILED[*]} (stderr in $DIR/logs)"
fi
rm -f "$DIR/failed-runs.txt"
log "$MODE: all runs done"

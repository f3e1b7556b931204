#!/usr/bin/env bash
# Byte flood: what bounds a gateway's memory when many clients send large frames as fast as
# they can. 20 devices (BENCH_FLOOD_CLIENTS) register on one aip-gateway and send 8 MiB
# (BENCH_FLOOD_MIB) `command_results` frames for 20 s (BENCH_FLOOD_SECONDS) while
# bench/byte_flood.py samples the gateway's RSS (VmRSS every 100 ms, VmHWM at the end) and its
# `aip_gateway_inbound_bytes_in_flight` gauge. Once per gateway configuration, each in a fresh
# gateway process:
#
#   budget-32m    max_inbound_bytes_in_flight = 32 MiB, no byte rate: the budget binds
#   budget-huge   max_inbound_bytes_in_flight = 64 GiB, no byte rate: no bound but the
#                 connections' own one frame at a time
#   defaults      the defaults (256 MiB budget, 16 MiB/s per connection)
#
# (BENCH_FLOOD_CONFIGS picks some: "budget-32m budget-huge".) A registry (PostgreSQL) answers
# the registrations; there is no session service: the frames and blob streams are created
# up front, capped at 2 GiB each, and nobody reads them, so only the gateway is measured.
#
# Results: DIR/<config>.json, DIR/summary.md, DIR/logs/, DIR/machine.json, with DIR
# bench/results/byte-flood-<date> (BENCH_FLOOD_DIR to choose). Binaries: AIP_BIN_DIR
# (default target/release; a debug build works too, slower: AIP_BIN_DIR=target/debug).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_init

CLIENTS="${BENCH_FLOOD_CLIENTS:-20}"
MIB="${BENCH_FLOOD_MIB:-8}"
SECONDS_="${BENCH_FLOOD_SECONDS:-20}"
CONFIGS="${BENCH_FLOOD_CONFIGS:-budget-32m budget-huge defaults}"
DIR="${BENCH_FLOOD_DIR:-$BENCH_RESULTS_DIR/byte-flood-$(date +%Y%m%d)}"
mkdir -p "$DIR/logs"
require_bins aip-registry aip-gateway
check_infra
record_machine "$DIR" infra
pg_create_db flood
new_prefix
log "byte flood: $CLIENTS clients, $MIB MiB frames, ${SECONDS_} s per configuration; prefix $BENCH_PREFIX"

COMMON=(env "AIP_NATS_URL=$BENCH_NATS_URL" "AIP_DATABASE_URL=$(pg_url "$BENCH_DB")"
  "AIP_SUBJECT_PREFIX=$BENCH_PREFIX" "RUST_LOG=${BENCH_RUST_LOG:-warn}")

REGISTRY_PORT="$(free_port)"
start_proc aip-registry "$DIR/logs/aip-registry.log" "${COMMON[@]}" \
  "AIP_REGISTRY__LISTEN=127.0.0.1:$REGISTRY_PORT" "$(bin aip-registry)"
wait_ready "http://127.0.0.1:$REGISTRY_PORT/readyz" "$STARTED_PID" aip-registry "$DIR/logs/aip-registry.log"
python3 "$BENCH_DIR/byte_flood.py" streams --nats-url "$BENCH_NATS_URL" --prefix "$BENCH_PREFIX"

# config_env CONFIG: the gateway's settings for CONFIG.
config_env() {
  case "$1" in
    budget-32m) echo "AIP_GATEWAY__MAX_INBOUND_BYTES_IN_FLIGHT=$((32 * 1024 * 1024)) AIP_GATEWAY__BYTES_PER_SECOND=0" ;;
    budget-huge) echo "AIP_GATEWAY__MAX_INBOUND_BYTES_IN_FLIGHT=$((64 * 1024 * 1024 * 1024)) AIP_GATEWAY__BYTES_PER_SECOND=0" ;;
    defaults) echo "" ;;
    *) die "unknown configuration $1 (budget-32m, budget-huge, defaults)" ;;
  esac
}

for config in $CONFIGS; do
  read -r -a settings <<<"$(config_env "$config")"
  port="$(free_port)"
  start_proc "aip-gateway-$config" "$DIR/logs/aip-gateway-$config.log" "${COMMON[@]}" \
    "AIP_GATEWAY__LISTEN=127.0.0.1:$port" "AIP_GATEWAY__GATEWAY_ID=$BENCH_PREFIX-$config" \
    AIP_GATEWAY__FRAMES_PER_SECOND=0 "${settings[@]}" "$(bin aip-gateway)"
  gateway="$STARTED_PID"
  wait_ready "http://127.0.0.1:$port/readyz" "$gateway" "aip-gateway-$config" "$DIR/logs/aip-gateway-$config.log"
  log "$config: ${settings[*]:-defaults}"
  python3 "$BENCH_DIR/byte_flood.py" --url "ws://127.0.0.1:$port/ws" --pid "$gateway" \
    --out "$DIR/$config.json" --label "$config ${settings[*]:-}" \
    --clients "$CLIENTS" --mib "$MIB" --seconds "$SECONDS_" >/dev/null
  stop_pid "$gateway" "aip-gateway-$config"
done

python3 - "$DIR" $CONFIGS >"$DIR/summary.md" <<'PY'
import json, sys
out, *configs = sys.argv[1:]
print("| configuration | MiB/s in | frames | VmHWM MiB | peak VmRSS MiB | median VmRSS MiB | in-flight gauge max MiB | RSS after 5 s MiB | ERROR frames |")
print("|---|---|---|---|---|---|---|---|---|")
for c in configs:
    r = json.load(open(f"{out}/{c}.json"))
    print(f"| {r['label']} | {r['mib_per_sec']} | {r['frames_sent']} | {r['vm_hwm_mib']} | {r['rss_peak_sampled_mib']} "
          f"| {r['rss_median_mib']} | {r['in_flight_gauge_max_mib']} | {r['rss_after_settle_mib']} | {r['error_frames']} |")
PY
cat "$DIR/summary.md" >&2
log "results in $DIR"

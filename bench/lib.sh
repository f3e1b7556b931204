# shellcheck shell=bash
# Shared functions of the bench/ scripts. Source it; do not run it.
#
#   BENCH_DIR, REPO_ROOT    where things are
#   AIP_BIN_DIR             the release binaries (default: $REPO_ROOT/target/release)
#   BENCH_RESULTS_DIR       where results go (default: bench/results, or bench/results-quick
#                           with BENCH_QUICK=1)
#   BENCH_NATS_URL          NATS for the distributed mode (default nats://127.0.0.1:4222)
#   BENCH_PG_HOST/PORT/USER PostgreSQL for the distributed mode (default 127.0.0.1 5432
#                           postgres, trust authentication)
#
# Every process started with start_proc, every database made with pg_create_db and every
# subject prefix given to nats_cleanup_later is stopped, dropped or cleaned up by the EXIT
# trap that bench_init installs, whether the script succeeds, fails or is interrupted.

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$BENCH_DIR/.." && pwd)"
AIP_BIN_DIR="${AIP_BIN_DIR:-$REPO_ROOT/target/release}"
BENCH_QUICK="${BENCH_QUICK:-0}"
if [[ "$BENCH_QUICK" == 1 ]]; then
  BENCH_RESULTS_DIR="${BENCH_RESULTS_DIR:-$BENCH_DIR/results-quick}"
else
  BENCH_RESULTS_DIR="${BENCH_RESULTS_DIR:-$BENCH_DIR/results}"
fi
BENCH_NATS_URL="${BENCH_NATS_URL:-nats://127.0.0.1:4222}"
BENCH_PG_HOST="${BENCH_PG_HOST:-127.0.0.1}"
BENCH_PG_PORT="${BENCH_PG_PORT:-5432}"
BENCH_PG_USER="${BENCH_PG_USER:-postgres}"
HELPERS=(python3 "$BENCH_DIR/helpers.py")

# State for the cleanup trap.
BENCH_PIDS=()        # processes we started, in start order
BENCH_PID_NAMES=()   # their names, same order
BENCH_DATABASES=()   # databases we created
BENCH_PREFIXES=()    # subject prefixes whose JetStream streams we remove
BENCH_TMPDIRS=()     # temporary directories we remove

log() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
warn() { printf '[bench %s] WARNING: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
  printf '[bench] ERROR: %s\n' "$1" >&2
  shift
  local line
  for line in "$@"; do printf '  %s\n' "$line" >&2; done
  exit 1
}

# bench_init: installs the cleanup trap; call once, first thing.
bench_init() {
  trap bench_cleanup EXIT
  trap 'log "interrupted"; exit 130' INT
  trap 'log "terminated"; exit 143' TERM
  command -v python3 >/dev/null || die "python3 is needed by the bench scripts"
  command -v curl >/dev/null || die "curl is needed by the bench scripts (apt-get install curl)"
  # 10,000 connections need as many file descriptors in the generator and the gateway.
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
}

# bin NAME: path of a release binary, or exit saying how to build it.
bin() {
  local path="$AIP_BIN_DIR/$1"
  [[ -x "$path" ]] || die "$path is missing or not executable." \
    "Build the release binaries first (from $REPO_ROOT):" \
    "  cargo build --release -p aip -p aip-gateway -p aip-registry -p aip-sessions" \
    "or point AIP_BIN_DIR at a directory that has them."
  printf '%s\n' "$path"
}

# require_bins NAME...: checks every binary at once (before anything is started).
require_bins() {
  local name
  for name in "$@"; do bin "$name" >/dev/null; done
}

free_port() { "${HELPERS[@]}" free-port; }

# random_suffix: 8 lower-case hex characters.
random_suffix() { python3 -c 'import uuid; print(uuid.uuid4().hex[:8])'; }

# make_tmpdir: a temporary directory removed on exit; sets BENCH_TMPDIR. (Not in $(...):
# the cleanup list must be this shell's.)
make_tmpdir() {
  BENCH_TMPDIR="$(mktemp -d "${TMPDIR:-/tmp}/aip-bench.XXXXXX")"
  BENCH_TMPDIRS+=("$BENCH_TMPDIR")
}

# start_proc NAME LOGFILE CMD...: starts CMD in the background with its output in LOGFILE,
# remembers it for the cleanup trap and sets STARTED_PID. Environment variables for CMD go
# before it with `env`, e.g. start_proc gw gw.log env A=1 "$(bin aip-gateway)".
start_proc() {
  local name="$1" logfile="$2"
  shift 2
  mkdir -p "$(dirname "$logfile")"
  printf '# %s\n' "$*" >"$logfile"
  "$@" >>"$logfile" 2>&1 </dev/null &
  STARTED_PID=$!
  BENCH_PIDS+=("$STARTED_PID")
  BENCH_PID_NAMES+=("$name")
  log "started $name (pid $STARTED_PID), log $logfile"
}

# run_tracked NAME CMD...: runs CMD in the background, killed by the cleanup trap if this
# script stops first, and waits for it; returns its exit status.
run_tracked() {
  local name="$1" pid status=0
  shift
  "$@" &
  pid=$!
  BENCH_PIDS+=("$pid")
  BENCH_PID_NAMES+=("$name")
  wait "$pid" || status=$?
  return "$status"
}

# alive PID: whether it runs.
alive() { kill -0 "$1" 2>/dev/null; }

# stop_pid PID NAME [GRACE_SECS]: SIGTERM, then SIGKILL after the grace period.
stop_pid() {
  local pid="$1" name="$2" grace="${3:-15}" i
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < grace * 10; i++)); do
    alive "$pid" || break
    sleep 0.1
  done
  if alive "$pid"; then
    warn "$name (pid $pid) did not stop within ${grace}s of SIGTERM: killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

# stop_all: stops every process we started, newest first (gateways before the services
# they talk to).
stop_all() {
  local i
  for ((i = ${#BENCH_PIDS[@]} - 1; i >= 0; i--)); do
    stop_pid "${BENCH_PIDS[i]}" "${BENCH_PID_NAMES[i]}"
  done
  BENCH_PIDS=()
  BENCH_PID_NAMES=()
}

bench_cleanup() {
  local status=$?
  trap - EXIT INT TERM
  set +e
  local pid running=0
  for pid in "${BENCH_PIDS[@]}"; do
    if alive "$pid"; then running=$((running + 1)); fi
  done
  if ((running)); then log "stopping $running process(es)"; fi
  stop_all
  local prefix db dir
  for prefix in "${BENCH_PREFIXES[@]}"; do
    "${HELPERS[@]}" nats-delete-streams --url "$BENCH_NATS_URL" --prefix "$prefix" >&2 ||
      warn "could not delete the JetStream streams of prefix $prefix (delete ${prefix}_frames and ${prefix}_blobs by hand)"
  done
  for db in "${BENCH_DATABASES[@]}"; do
    if psql_admin -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null; then
      log "dropped database $db"
    else
      warn "could not drop database $db"
    fi
  done
  for dir in "${BENCH_TMPDIRS[@]}"; do
    rm -rf -- "$dir"
  done
  exit "$status"
}

# wait_ready URL PID NAME LOGFILE [TIMEOUT_SECS]: waits until URL answers 2xx while PID
# runs; on failure shows the end of the log and exits.
wait_ready() {
  local url="$1" pid="$2" name="$3" logfile="$4" timeout="${5:-60}" i
  for ((i = 0; i < timeout * 5; i++)); do
    if ! alive "$pid"; then
      tail -n 30 "$logfile" >&2 || true
      die "$name (pid $pid) exited before it was ready; its log is $logfile (end above)"
    fi
    if curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; then
      log "$name ready ($url)"
      return 0
    fi
    sleep 0.2
  done
  tail -n 30 "$logfile" >&2 || true
  die "$name (pid $pid) was not ready at $url within ${timeout}s; its log is $logfile"
}

# --- PostgreSQL and NATS (distributed mode) ------------------------------------

psql_admin() {
  psql -X -q -v ON_ERROR_STOP=1 -h "$BENCH_PG_HOST" -p "$BENCH_PG_PORT" -U "$BENCH_PG_USER" \
    -d postgres "$@"
}

# check_infra: NATS with JetStream and PostgreSQL answer.
check_infra() {
  command -v psql >/dev/null || die "psql is needed for the distributed mode (apt-get install postgresql-client)"
  local info
  info="$("${HELPERS[@]}" nats-info --url "$BENCH_NATS_URL" 2>&1)" ||
    die "NATS does not answer at $BENCH_NATS_URL: $info" "Start it with ./scripts/ensure-services.sh"
  [[ "$info" == *'"jetstream": true'* ]] ||
    die "NATS at $BENCH_NATS_URL runs without JetStream (start nats-server with -js)"
  psql_admin -tAc 'SELECT 1' >/dev/null 2>&1 ||
    die "PostgreSQL does not accept 'psql -h $BENCH_PG_HOST -p $BENCH_PG_PORT -U $BENCH_PG_USER' (trust authentication expected)" \
      "Start it with ./scripts/ensure-services.sh"
}

# start_own_postgres LOGDIR TRANSPORT: `initdb` a throwaway PostgreSQL cluster with the
# server's defaults (autovacuum on, fsync and synchronous_commit on, no TLS; only its logging
# differs, below) in a temporary directory, start it and point BENCH_PG_* at it. TRANSPORT:
# `tcp` (127.0.0.1, a free port: what compose and Kubernetes use) or `socket` (its directory
# only). Needs root: initdb runs
# as the postgres user. On exit the cluster is stopped and its directory removed; its
# databases are not dropped one by one.
start_own_postgres() {
  local logdir="$1" transport="$2" pg_dir listen=""
  [[ "$(id -u)" -eq 0 ]] || die "an own PostgreSQL cluster needs root (initdb runs as postgres)"
  local pg_bin="${PG_BIN:-/usr/lib/postgresql/15/bin}"
  [[ -x "$pg_bin/initdb" ]] || die "no initdb in $pg_bin (set PG_BIN to PostgreSQL's bin directory)"
  make_tmpdir
  chmod 755 "$BENCH_TMPDIR"
  pg_dir="$BENCH_TMPDIR/pg"
  mkdir "$pg_dir" && chown postgres:postgres "$pg_dir"
  runuser -u postgres -- "$pg_bin/initdb" -D "$pg_dir" -A trust -U postgres >"$logdir/initdb.log" 2>&1 ||
    die "initdb failed; see $logdir/initdb.log"
  BENCH_PG_PORT="$(free_port)"
  BENCH_PG_USER=postgres
  case "$transport" in
    tcp) BENCH_PG_HOST=127.0.0.1 BENCH_PG_SOCKET_DIR="" listen=127.0.0.1 ;;
    socket) BENCH_PG_HOST="$pg_dir" BENCH_PG_SOCKET_DIR="$pg_dir" ;;
    *) die "start_own_postgres: transport must be tcp or socket, got '$transport'" ;;
  esac
  # Logging only, so that a slow window can be laid beside what the server did meanwhile:
  # every checkpoint and autovacuum run, and (BENCH_PG_SLOW_MS) statements slower than that.
  local logging=(-c log_checkpoints=on -c log_autovacuum_min_duration=0)
  if [[ -n "${BENCH_PG_SLOW_MS:-}" ]]; then
    logging+=(-c "log_min_duration_statement=${BENCH_PG_SLOW_MS}ms")
  fi
  start_proc postgres "$logdir/postgres.log" runuser -u postgres -- "$pg_bin/postgres" \
    -D "$pg_dir" -p "$BENCH_PG_PORT" -k "$pg_dir" -c listen_addresses="$listen" "${logging[@]}"
  local _ ready=0
  for _ in $(seq 100); do
    if psql_admin -tAc 'SELECT 1' >/dev/null 2>&1; then ready=1; break; fi
    sleep 0.1
  done
  ((ready)) || die "the own PostgreSQL cluster did not accept connections within 10 s; see $logdir/postgres.log"
  BENCH_OWN_PG=1
  log "own PostgreSQL cluster in $pg_dir, port $BENCH_PG_PORT over $transport (server defaults)"
}
BENCH_OWN_PG=0

# pg_create_db TAG: creates aip_bench_TAG_<random>, dropped on exit (with the cluster, for an
# own cluster); sets BENCH_DB.
pg_create_db() {
  BENCH_DB="aip_bench_${1}_$(random_suffix)"
  if [[ "$BENCH_OWN_PG" != 1 ]]; then BENCH_DATABASES+=("$BENCH_DB"); fi
  psql_admin -c "CREATE DATABASE \"$BENCH_DB\"" >/dev/null ||
    die "could not create database $BENCH_DB"
  log "created database $BENCH_DB"
}

# pg_url DB: the services' database URL: TCP, the path compose and Kubernetes use. Set
# BENCH_PG_SOCKET_DIR (e.g. /var/run/postgresql) to use PostgreSQL's Unix socket there instead,
# to compare the two (they should run at the same speed; docs/benchmarks.md).
BENCH_PG_SOCKET_DIR="${BENCH_PG_SOCKET_DIR-}"
pg_url() {
  if [[ -n "$BENCH_PG_SOCKET_DIR" && -S "$BENCH_PG_SOCKET_DIR/.s.PGSQL.$BENCH_PG_PORT" ]]; then
    printf 'postgres://%s@localhost:%s/%s?host=%s\n' "$BENCH_PG_USER" "$BENCH_PG_PORT" "$1" "$BENCH_PG_SOCKET_DIR"
  else
    printf 'postgres://%s@%s:%s/%s\n' "$BENCH_PG_USER" "$BENCH_PG_HOST" "$BENCH_PG_PORT" "$1"
  fi
}

# new_prefix: a fresh subject prefix (bench<hex>) whose streams are deleted on exit; sets
# BENCH_PREFIX.
new_prefix() {
  BENCH_PREFIX="bench$(random_suffix)"
  BENCH_PREFIXES+=("$BENCH_PREFIX")
}

# infra_pids DB: pids of nats-server and of the PostgreSQL processes serving DB, for
# --server-pid (the backends of DB are the ones alive now: warm the pools first).
infra_pids() {
  local nats
  nats="$(pgrep -x nats-server | tr '\n' ' ')"
  printf '%s %s\n' "$nats" "$("${HELPERS[@]}" pg-pids --db "$1")"
}

# record_machine MODE_DIR: writes MODE_DIR/machine.json.
record_machine() {
  local args=(machine)
  if [[ "${2:-}" == infra ]]; then
    args+=(--nats-url "$BENCH_NATS_URL" --pg-host "$BENCH_PG_HOST" --pg-port "$BENCH_PG_PORT" --pg-user "$BENCH_PG_USER")
  fi
  "${HELPERS[@]}" "${args[@]}" >"$1/machine.json"
}

# json_array ARG...: the arguments as a JSON array (for the records of commands).
json_array() { python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "$@"; }

# prepare_mode_dir MODE: a fresh results directory for MODE; prints its path.
prepare_mode_dir() {
  local dir="$BENCH_RESULTS_DIR/$1"
  rm -rf -- "$dir"
  mkdir -p "$dir/logs"
  printf '%s\n' "$dir"
}

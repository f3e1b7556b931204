#!/usr/bin/env bash
# Makes sure the services the tests need are up:
#   - NATS with JetStream   on $NATS_URL      (default nats://127.0.0.1:4222)
#   - PostgreSQL            on $DATABASE_URL  (default postgres://postgres@127.0.0.1:5432/postgres)
#
# For each service: if it answers, nothing is done. Otherwise, when it is meant
# to run on this machine (loopback host, default port), it is started if
# installed, or installed from Debian's packages (apt-get) and then started.
# A service that is already running is never stopped, restarted or
# reconfigured. Safe to run repeatedly.
#
# Environment:
#   NATS_URL, DATABASE_URL          where the services are expected
#   ENSURE_SERVICES_TIMEOUT         seconds to wait for them to come up (default 60)
#
# Exit status: 0 when both services are up (NATS with JetStream, PostgreSQL
# accepting a connection), non-zero with a message saying what failed otherwise.
set -euo pipefail

PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
export PATH

TIMEOUT="${ENSURE_SERVICES_TIMEOUT:-60}"
NATS_DEFAULT_URL="nats://127.0.0.1:4222"
PG_DEFAULT_URL="postgres://postgres@127.0.0.1:5432/postgres"
NATS_BIN="/usr/sbin/nats-server"
NATS_STORE_DIR="/var/lib/nats-server"
NATS_LOG="/var/log/nats-server.log"
HBA_MARKER="# added by aip scripts/ensure-services.sh (trust auth on loopback for tests)"

log() { printf 'ensure-services: %s\n' "$*"; }
warn() { printf 'ensure-services: WARNING: %s\n' "$*" >&2; }
die() {
  printf 'ensure-services: ERROR: %s\n' "$1" >&2
  shift
  local line
  for line in "$@"; do printf '  %s\n' "$line" >&2; done
  exit 1
}

is_root() { [[ "$(id -u)" -eq 0 ]]; }

# --- URL parsing --------------------------------------------------------------

# parse_hostport URL DEFAULT_PORT -> prints "HOST PORT"
# Accepts scheme://[user[:pass]@]host[:port][/path][?query], bare host[:port],
# bracketed IPv6 literals, and comma-separated lists (the first entry is used).
parse_hostport() {
  local u="$1" def="$2" host port rest
  u="${u%%,*}"
  u="${u#*://}"
  u="${u%%[/?#]*}"
  u="${u##*@}"
  if [[ "$u" == \[* ]]; then
    host="${u%%]*}"
    host="${host#[}"
    rest="${u#*]}"
    port="${rest#:}"
  elif [[ "$u" == *:* ]]; then
    host="${u%:*}"
    port="${u##*:}"
  else
    host="$u"
    port=""
  fi
  [[ -n "$host" ]] || host="127.0.0.1"
  [[ -n "$port" ]] || port="$def"
  [[ "$port" =~ ^[0-9]+$ ]] || die "cannot read a port number from '$1' (got '$port')."
  printf '%s %s\n' "$host" "$port"
}

is_local_host() {
  case "$1" in
    127.* | localhost | ::1 | 0:0:0:0:0:0:0:1) return 0 ;;
    *) return 1 ;;
  esac
}

# --- probes -------------------------------------------------------------------

# nats_info HOST PORT: prints the server's INFO line; fails if nothing answers.
# shellcheck disable=SC2016 # $0/$1 are expanded by the inner bash
nats_info() {
  local line
  line="$(timeout 5 bash -c '
    exec 3<>"/dev/tcp/$0/$1" || exit 1
    IFS= read -r -t 4 line <&3 || exit 1
    printf "%s\n" "$line"
  ' "$1" "$2" 2>/dev/null)" || return 1
  printf '%s\n' "${line//$'\r'/}"
}

nats_up() {
  local info
  info="$(nats_info "$1" "$2")" || return 1
  [[ "$info" == INFO* ]]
}

nats_has_jetstream() {
  local info
  info="$(nats_info "$1" "$2")" || return 1
  [[ "$info" == INFO* && "$info" == *'"jetstream":true'* ]]
}

# shellcheck disable=SC2016 # $0/$1 are expanded by the inner bash
tcp_open() {
  timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

pg_up() {
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -q -h "$1" -p "$2" -t 3 >/dev/null 2>&1
  else
    tcp_open "$1" "$2"
  fi
}

# --- installing -----------------------------------------------------------------

APT_UPDATED=0
apt_install() {
  local pkgs=("$@")
  if ! is_root; then
    die "${pkgs[*]} must be installed, and that needs root." \
      "Run as root:  apt-get update && apt-get install -y ${pkgs[*]}" \
      "then run this script again (or run it as root: it installs them itself)."
  fi
  command -v apt-get >/dev/null 2>&1 ||
    die "${pkgs[*]} must be installed, but apt-get was not found (this script knows Debian only)." \
      "Install ${pkgs[*]} by other means and run this script again."
  export DEBIAN_FRONTEND=noninteractive
  if [[ "$APT_UPDATED" -eq 0 ]]; then
    log "apt-get update"
    if ! apt-get -o DPkg::Lock::Timeout=300 update -qq; then
      warn "apt-get update failed; trying the install with the package lists already on this machine."
    fi
    APT_UPDATED=1
  fi
  log "apt-get install -y ${pkgs[*]}"
  apt-get -o DPkg::Lock::Timeout=300 install -y -q "${pkgs[@]}" ||
    die "apt-get install ${pkgs[*]} failed (see apt's output above)." \
      "Check that Debian's package mirror is reachable and run this script again."
}

# --- PostgreSQL -------------------------------------------------------------------

pg_installed() {
  command -v pg_ctlcluster >/dev/null 2>&1 && command -v pg_lsclusters >/dev/null 2>&1 &&
    compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null
}

# pg_cluster_on_port PORT -> prints "VERSION NAME STATUS" of the cluster configured for PORT
pg_cluster_on_port() {
  pg_lsclusters -h 2>/dev/null | awk -v p="$1" '$3 == p { print $1, $2, $4; exit }'
}

# Add trust rules for loopback TCP at the top of a (freshly created) cluster's pg_hba.conf.
pg_trust_loopback() {
  local ver="$1" name="$2" hba
  hba="/etc/postgresql/$ver/$name/pg_hba.conf"
  [[ -f "$hba" ]] || die "pg_hba.conf of cluster $ver/$name not found at $hba."
  if grep -qF "$HBA_MARKER" "$hba"; then
    return 0
  fi
  log "configuring trust authentication on 127.0.0.1 and ::1 in $hba"
  local tmp
  tmp="$(mktemp)"
  {
    printf '%s\n' "$HBA_MARKER"
    printf 'host    all             all             127.0.0.1/32            trust\n'
    printf 'host    all             all             ::1/128                 trust\n'
    cat "$hba"
  } >"$tmp"
  cat "$tmp" >"$hba" # keeps the file's owner and mode
  rm -f "$tmp"
}

pg_start() {
  local host="$1" port="$2" fresh="$PG_FRESH" cluster ver name status
  pg_installed || die "PostgreSQL not found (Debian package 'postgresql')."

  cluster="$(pg_cluster_on_port "$port")"
  if [[ -z "$cluster" ]]; then
    if [[ "$fresh" -eq 1 ]] || ! pg_lsclusters -h 2>/dev/null | grep -q .; then
      ver="$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n1)"
      is_root || die "no PostgreSQL cluster exists; creating one needs root." \
        "Run as root:  pg_createcluster $ver main --port $port"
      log "creating PostgreSQL cluster $ver/main on port $port"
      pg_createcluster "$ver" main --port "$port" >/dev/null
      fresh=1
      cluster="$(pg_cluster_on_port "$port")"
    fi
  fi
  [[ -n "$cluster" ]] || die "no PostgreSQL cluster is configured for port $port." \
    "Clusters on this machine:" "$(pg_lsclusters 2>&1 || true)" \
    "Start one on port $port, or set DATABASE_URL to the one you want."
  read -r ver name status <<<"$cluster"

  if [[ "$fresh" -eq 1 ]]; then
    pg_trust_loopback "$ver" "$name"
  fi

  if [[ "$status" == online* ]]; then
    if [[ "$fresh" -eq 1 ]]; then
      log "reloading freshly installed cluster $ver/$name to apply pg_hba.conf"
      pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" reload
    else
      log "PostgreSQL cluster $ver/$name is running but not accepting connections on $host:$port yet; waiting"
    fi
    return 0
  fi

  log "starting PostgreSQL cluster $ver/$name: pg_ctlcluster --skip-systemctl-redirect $ver $name start"
  if ! pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start; then
    is_root || die "could not start PostgreSQL cluster $ver/$name as user $(id -un)." \
      "Run as root:  pg_ctlcluster --skip-systemctl-redirect $ver $name start"
    die "pg_ctlcluster could not start PostgreSQL cluster $ver/$name." \
      "Its log: /var/log/postgresql/postgresql-$ver-$name.log" \
      "$(tail -n 15 "/var/log/postgresql/postgresql-$ver-$name.log" 2>/dev/null || true)"
  fi
}

# --- NATS ---------------------------------------------------------------------------

nats_start() {
  local host="$1" port="$2" ssd
  [[ -x "$NATS_BIN" ]] || die "$NATS_BIN not found (Debian package 'nats-server')."

  if ! is_root && { ! mkdir -p "$NATS_STORE_DIR" 2>/dev/null || [[ ! -w "$NATS_STORE_DIR" ]]; }; then
    die "NATS is not running, and user $(id -un) cannot write its JetStream store $NATS_STORE_DIR." \
      "Run as root:  start-stop-daemon --start --oknodo --background --exec $NATS_BIN -- -a 127.0.0.1 -p $port -js -sd $NATS_STORE_DIR -l $NATS_LOG"
  fi
  mkdir -p "$NATS_STORE_DIR" "$(dirname "$NATS_LOG")"
  ssd="$(command -v start-stop-daemon || true)"
  [[ -n "$ssd" ]] || die "start-stop-daemon not found (Debian package dpkg)."
  log "starting nats-server with JetStream on 127.0.0.1:$port (store $NATS_STORE_DIR, log $NATS_LOG)"
  "$ssd" --start --oknodo --background --exec "$NATS_BIN" -- \
    -a 127.0.0.1 -p "$port" -js -sd "$NATS_STORE_DIR" -l "$NATS_LOG" ||
    die "start-stop-daemon could not start $NATS_BIN."
}

# --- main ---------------------------------------------------------------------------

nats_hp="$(parse_hostport "${NATS_URL:-$NATS_DEFAULT_URL}" 4222)"
pg_hp="$(parse_hostport "${DATABASE_URL:-$PG_DEFAULT_URL}" 5432)"
read -r NATS_HOST NATS_PORT <<<"$nats_hp"
read -r PG_HOST PG_PORT <<<"$pg_hp"
[[ "$NATS_HOST" == localhost ]] && NATS_HOST=127.0.0.1
[[ "$PG_HOST" == localhost ]] && PG_HOST=127.0.0.1

# May this script start/install the service itself? Only the machine's own
# default instance: loopback and the default port.
can_manage() { is_local_host "$1" && [[ "$2" == "$3" ]]; }

NATS_RUNNING=0
PG_RUNNING=0
nats_up "$NATS_HOST" "$NATS_PORT" && NATS_RUNNING=1
pg_up "$PG_HOST" "$PG_PORT" && PG_RUNNING=1

# Install what is missing for a service that must be started here, in one apt-get call.
to_install=()
if [[ "$NATS_RUNNING" -eq 0 ]] && can_manage "$NATS_HOST" "$NATS_PORT" 4222 && [[ ! -x "$NATS_BIN" ]]; then
  log "nats-server is not installed"
  to_install+=(nats-server)
fi
PG_FRESH=0
if [[ "$PG_RUNNING" -eq 0 ]] && can_manage "$PG_HOST" "$PG_PORT" 5432 && ! pg_installed; then
  log "PostgreSQL is not installed"
  to_install+=(postgresql)
  PG_FRESH=1
fi
if [[ "${#to_install[@]}" -gt 0 ]]; then
  log "installing from Debian's packages: ${to_install[*]}"
  apt_install "${to_install[@]}"
fi

# NATS
if [[ "$NATS_RUNNING" -eq 1 ]]; then
  log "NATS is up on $NATS_HOST:$NATS_PORT"
elif can_manage "$NATS_HOST" "$NATS_PORT" 4222; then
  log "NATS does not answer on $NATS_HOST:$NATS_PORT"
  nats_start "$NATS_HOST" "$NATS_PORT"
else
  die "NATS does not answer on $NATS_HOST:$NATS_PORT (from NATS_URL=${NATS_URL:-})." \
    "This script only starts the local default instance (127.0.0.1:4222)." \
    "Start NATS with JetStream (nats-server -js) there, or unset NATS_URL."
fi

# PostgreSQL
if [[ "$PG_RUNNING" -eq 1 ]]; then
  log "PostgreSQL is up on $PG_HOST:$PG_PORT"
elif can_manage "$PG_HOST" "$PG_PORT" 5432; then
  log "PostgreSQL does not answer on $PG_HOST:$PG_PORT"
  pg_start "$PG_HOST" "$PG_PORT"
else
  die "PostgreSQL does not answer on $PG_HOST:$PG_PORT (from DATABASE_URL)." \
    "This script only starts the local default instance (127.0.0.1:5432)." \
    "Start PostgreSQL there, or unset DATABASE_URL."
fi

# Wait for both, with a deadline.
deadline=$((SECONDS + TIMEOUT))
nats_ok=0
pg_ok=0
while :; do
  [[ "$nats_ok" -eq 1 ]] || { nats_up "$NATS_HOST" "$NATS_PORT" && nats_ok=1; } || true
  [[ "$pg_ok" -eq 1 ]] || { pg_up "$PG_HOST" "$PG_PORT" && pg_ok=1; } || true
  if [[ "$nats_ok" -eq 1 && "$pg_ok" -eq 1 ]]; then
    break
  fi
  if ((SECONDS >= deadline)); then
    if [[ "$nats_ok" -ne 1 ]]; then
      printf 'ensure-services: ERROR: NATS did not answer on %s:%s within %ss.\n' "$NATS_HOST" "$NATS_PORT" "$TIMEOUT" >&2
      printf '  nats-server processes: %s\n' "$(pgrep -a nats-server 2>/dev/null | tr '\n' ';' || true)" >&2
      if [[ -r "$NATS_LOG" ]]; then
        printf '  last lines of %s:\n' "$NATS_LOG" >&2
        tail -n 10 "$NATS_LOG" | sed 's/^/    /' >&2
      fi
      printf '  Start it by hand: start-stop-daemon --start --oknodo --background --exec %s -- -a 127.0.0.1 -p 4222 -js -sd %s -l %s\n' \
        "$NATS_BIN" "$NATS_STORE_DIR" "$NATS_LOG" >&2
    fi
    if [[ "$pg_ok" -ne 1 ]]; then
      printf 'ensure-services: ERROR: PostgreSQL did not accept connections on %s:%s within %ss.\n' "$PG_HOST" "$PG_PORT" "$TIMEOUT" >&2
      if command -v pg_lsclusters >/dev/null 2>&1; then
        pg_lsclusters 2>&1 | sed 's/^/    /' >&2 || true
      fi
      # shellcheck disable=SC2016 # printed for the reader to run
      printf '  Start it by hand: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n' >&2
      printf '  and see its log under /var/log/postgresql/.\n' >&2
      printf '  If the cluster shows "online", check listen_addresses and port in its postgresql.conf\n' >&2
      printf '  (it must listen on %s:%s).\n' "$PG_HOST" "$PG_PORT" >&2
    fi
    exit 1
  fi
  sleep 1
done

# JetStream must be on. A running server is never restarted by this script.
if ! nats_has_jetstream "$NATS_HOST" "$NATS_PORT"; then
  die "NATS on $NATS_HOST:$NATS_PORT runs WITHOUT JetStream (its INFO lacks \"jetstream\":true)." \
    "The tests need JetStream. This script does not restart a running server:" \
    "stop that nats-server yourself and run this script again (it starts one with -js), or" \
    "restart it with JetStream enabled (nats-server -js -sd <store dir>)."
fi
log "NATS on $NATS_HOST:$NATS_PORT has JetStream enabled"

# PostgreSQL must let the tests in (trust auth or the credentials in DATABASE_URL).
if command -v psql >/dev/null 2>&1; then
  pg_url="${DATABASE_URL:-$PG_DEFAULT_URL}"
  pg_url="${pg_url%%\?*}" # query options may be client-specific (sqlx); libpq rejects unknown ones
  if ! pg_err="$(PGCONNECT_TIMEOUT=5 psql "$pg_url" -X -q -A -t -c 'select 1' 2>&1 >/dev/null)"; then
    die "PostgreSQL on $PG_HOST:$PG_PORT accepts connections, but logging in failed:" \
      "$pg_err" \
      "The tests connect as given by DATABASE_URL (default $PG_DEFAULT_URL)." \
      "Allow it, e.g. with a line 'host all all 127.0.0.1/32 trust' at the top of the cluster's" \
      "pg_hba.conf (/etc/postgresql/<version>/main/pg_hba.conf) followed by" \
      "'pg_ctlcluster --skip-systemctl-redirect <version> main reload'."
  fi
  log "PostgreSQL on $PG_HOST:$PG_PORT accepts logins"
else
  warn "psql not found: only checked that PostgreSQL accepts connections, not that the login works."
fi
log "all services are up"

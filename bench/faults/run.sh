#!/usr/bin/env bash
# Fault-injection harness (issue 14): see bench/faults/harness.py and docs/reliability.md.
# Usage: bench/faults/run.sh [--scale small|full] [--faults none,nats-kill,...] [--strict]
# Needs the debug binaries: cargo build -p aip-gateway -p aip-registry -p aip-sessions
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$here/../.." && pwd)/target}"
for b in aip-gateway aip-registry aip-sessions; do
  [[ -x "$CARGO_TARGET_DIR/debug/$b" ]] || { echo "faults: $CARGO_TARGET_DIR/debug/$b missing; cargo build -p aip-gateway -p aip-registry -p aip-sessions" >&2; exit 2; }
done
exec python3 "$here/harness.py" "$@"

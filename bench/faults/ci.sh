#!/usr/bin/env bash
# The fault harness at CI scale (4 devices + 4 constellations, 8 s of load, the fault at 3 s,
# 12 s to settle; about 3 minutes): exits 1 unless every row is clean.
# The partition fault needs `ip netns` (root); it is left to the full-scale run.
# Needs the debug binaries of aip-gateway, aip-registry and aip-sessions.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$here/run.sh" --scale small --strict \
  --faults none,sessions-kill,postgres-stop,gateway-kill,gateway-kill-new-id,nats-kill,registry-kill,sessions-sigstop "$@"

#!/usr/bin/env bash
# Stops what deploy/ha-local/start.sh started (the same ORTQ_HA_DIR) and removes its files.
set -uo pipefail
dir=${ORTQ_HA_DIR:-/tmp/ortq-ha}
for pidfile in "$dir"/*.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
for pidfile in "$dir"/*.pid; do  # each one gone before its files go
    while [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; do sleep 0.1; done
done
rm -rf "$dir"

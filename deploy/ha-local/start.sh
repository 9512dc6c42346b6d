#!/usr/bin/env bash
# A local Redis Sentinel group to try ortq's failover with (docs/ha.md, "A local Sentinel group"):
# a primary, a replica and three sentinels on 127.0.0.1, as tests/test_sentinel.py starts them.
#
#   bash deploy/ha-local/start.sh            # prints the redis+sentinel:// URL to use
#   bash deploy/ha-local/stop.sh
#
# Ports: ORTQ_HA_PRIMARY (6390), ORTQ_HA_REPLICA (the next one), ORTQ_HA_SENTINELS (three,
# space-separated: 26390 26391 26392). State, configs and logs go to ORTQ_HA_DIR (/tmp/ortq-ha). Needs redis-server
# (and redis-sentinel, or redis-server's --sentinel mode) on PATH; valkey-server works the same.
set -euo pipefail
dir=${ORTQ_HA_DIR:-/tmp/ortq-ha}
primary=${ORTQ_HA_PRIMARY:-6390}
replica=${ORTQ_HA_REPLICA:-$((primary + 1))}
sentinels=${ORTQ_HA_SENTINELS:-26390 26391 26392}
service=${ORTQ_HA_SERVICE:-ortq}
server=$(command -v redis-server || command -v valkey-server) || { echo "no redis-server on PATH" >&2; exit 1; }
mkdir -p "$dir"

data_node() {  # PORT [ARGS...]: a data node that keeps what it had over a restart (append-only file)
    local port=$1; shift
    mkdir -p "$dir/node-$port"
    # min-replicas-to-write 1: a primary whose replica was promoted refuses writes at once instead
    # of taking writes the next failover step throws away (docs/ha.md, "What a failover loses").
    "$server" --port "$port" --bind 127.0.0.1 --dir "$dir/node-$port" --daemonize yes \
        --pidfile "$dir/node-$port.pid" --logfile "$dir/node-$port.log" \
        --save "" --appendonly yes --appendfsync everysec \
        --min-replicas-to-write 1 --min-replicas-max-lag 10 --repl-diskless-sync-delay 0 "$@"
}
data_node "$primary"
data_node "$replica" --replicaof 127.0.0.1 "$primary"
# Writes need the replica (min-replicas-to-write): wait for its first sync where redis-cli is there.
cli=$(command -v redis-cli || command -v valkey-cli || true)
for _ in $(seq 100); do
    [ -z "$cli" ] && break
    "$cli" -p "$primary" info replication 2>/dev/null | grep -q "state=online" && break
    sleep 0.1
done

hosts=""
for port in $sentinels; do
    cat > "$dir/sentinel-$port.conf" <<CONF
port $port
bind 127.0.0.1
dir $dir
daemonize yes
pidfile $dir/sentinel-$port.pid
logfile $dir/sentinel-$port.log
sentinel monitor $service 127.0.0.1 $primary 2
sentinel down-after-milliseconds $service 2000
sentinel failover-timeout $service 10000
sentinel parallel-syncs $service 1
CONF
    if [[ $(basename "$(readlink -f "$server")") != valkey* ]] && command -v redis-sentinel >/dev/null; then
        redis-sentinel "$dir/sentinel-$port.conf"
    else
        "$server" "$dir/sentinel-$port.conf" --sentinel
    fi
    hosts="$hosts${hosts:+,}127.0.0.1:$port"
done
echo "redis+sentinel://$hosts/$service/0"

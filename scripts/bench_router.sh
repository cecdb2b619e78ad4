#!/usr/bin/env bash
# kvserve bench on a shared-system-prompt workload, three ways in one run, each with cold caches:
#   single       one replica alone
#   cache_aware  two replicas behind sglang-router, prefix-cache-aware policy (docker/compose.router.yaml's)
#   round_robin  the same two replicas behind the same router, round-robin
# The machine's cores are split between the replicas (OMP_NUM_THREADS), as CPU limits would split them in a
# cluster: one replica alone gets them all, two get half each.
# Needs the test extras (sglang-router): bash scripts/install.sh --test. Prints one JSON summary per set-up.
#
#   scripts/bench_router.sh [kvserve bench flags...]    e.g. --concurrency 16 --num-requests 128
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
base=${BASE_PORT:-18600}
logs=$(mktemp -d)
pids=()
stop() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap stop EXIT

wait_for() {  # URL: until it answers 200
    for _ in $(seq 600); do curl -sf -o /dev/null "$1" && return 0; sleep 0.5; done
    echo "no answer from $1; logs in $logs" >&2; exit 1
}

cores=$(nproc)
replica() {  # PORT THREADS
    OMP_NUM_THREADS=$2 $py -m server.cli serve --port "$1" --served-model-name bench ${KVSERVE_FLAGS:-} >"$logs/replica$1.log" 2>&1 &
    pids+=($!)
    wait_for "http://127.0.0.1:$1/health"
}

router() {  # POLICY PORT WORKER...
    local policy=$1 port=$2; shift 2
    NO_COLOR=1 $py -m sglang_router.launch_router --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 \
        --prometheus-port $((port + 1)) --policy "$policy" --worker-urls "$@" --health-check-interval-secs 5 \
        --health-failure-threshold 2 --cb-failure-threshold 2 --log-level warn >"$logs/router-$policy.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/v1/models" | grep -q '"bench"' && return 0; sleep 0.5
    done
    echo "the router did not register the replicas; logs in $logs" >&2; exit 1
}

bench() {  # NAME URL
    echo "== $1" >&2
    $py -m server.cli bench --url "$2" "${@:3}" | tail -1 | $py -c "import json, sys; print(json.dumps({'setup': '$1', **json.loads(sys.stdin.read())}))"
}

replica $base "$cores"
bench single "http://127.0.0.1:$base" "$@"
stop

for policy in cache_aware round_robin; do
    replica $((base + 1)) $(((cores + 1) / 2))
    replica $((base + 2)) $(((cores + 1) / 2))
    router $policy $((base + 10)) "http://127.0.0.1:$((base + 1))" "http://127.0.0.1:$((base + 2))"
    bench "$policy" "http://127.0.0.1:$((base + 10))" "$@"
    stop
done

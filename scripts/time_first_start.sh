#!/usr/bin/env bash
# How long a newcomer waits: a fresh clone's `make serve` until it answers its first chat request, with the
# moment each part of it was done (the README's first screen quotes this).
#
#   scripts/time_first_start.sh [REPOSITORY] [COMMIT]     (default: this checkout, its HEAD)
#
# Clones into a new folder under ${TMPDIR:-/tmp} (its own .venv and weights/: nothing of this checkout's is
# reused but pip's cache), runs `make serve` there on PORT (default 18000) and asks it "What is the capital of
# France?" once /health answers. Prints, in seconds from the start: the venv made, torch unpacked, kvserve and
# its dependencies installed, each kernel tier built, the server started, the model's GGUF fetched, /health
# answering, and the first answer; then the CPU seconds the install and the server took by then (a figure that
# another job on the host moves less than the wall time). Stops the server and removes the clone at the end
# (KEEP=1 keeps it). NICE (default 0) runs `make serve` under that niceness.
set -euo pipefail
repo=${1:-$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)}
commit=${2:-$(git -C "$repo" rev-parse HEAD)}
port=${PORT:-18000}
dest=$(mktemp -d "${TMPDIR:-/tmp}/first-start.XXXXXX")
git clone -q "$repo" "$dest/kvserve"
cd "$dest/kvserve"
git checkout -q "$commit"
echo "commit $(git rev-parse --short HEAD), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"

start=$(date +%s.%N)
since() { awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%6.1f s", b - a }'; }
setsid nice -n "${NICE:-0}" make serve ARGS="--port $port" >"$dest/make.log" 2>&1 &
make_pid=$!
cleanup() {
    kill -- "-$make_pid" 2>/dev/null || true
    wait "$make_pid" 2>/dev/null || true
    [ -n "${KEEP:-}" ] && echo "kept: $dest" || rm -rf "$dest"
}
trap cleanup EXIT

declare -A done_
mark() { [ -n "${done_[$1]:-}" ] || { done_[$1]=1; echo "$(since)  $1"; }; }
cpu_s() { awk '{ printf "%.1f", ($14 + $15 + $16 + $17) / 100 }' "/proc/$1/stat" 2>/dev/null || echo 0; }
question='{"model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0,
           "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
site=.venv/lib/python3*/site-packages
for _ in $(seq 1 3600); do
    [ -x .venv/bin/python ] && mark "venv made"
    compgen -G "$site/torch/version.py" >/dev/null && mark "torch unpacked"
    [ -f .venv/.kvserve-installed ] && mark "kvserve and its dependencies installed"
    for tier in .venv/share/kvserve/kernels/*-*; do
        [ -d "$tier" ] && mark "kernels built: $(basename "$tier" | cut -d- -f1)"
    done
    server=$(pgrep -P "$make_pid" -f "kvserve serve" | head -1 || true)
    [ -n "$server" ] && mark "server started"
    compgen -G "weights/gguf/*.gguf" >/dev/null && mark "model fetched"
    if curl -sf -o /dev/null "http://127.0.0.1:$port/health"; then
        mark "/health answers"
        if answer=$(curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
            -d "$question"); then
            mark "first answer"
            echo "CPU seconds by then: the install $(awk '{ printf "%.1f", ($16 + $17) / 100 }' "/proc/$make_pid/stat"), the server $(cpu_s "$server")"
            echo "$answer" | head -c 400
            echo
            exit 0
        fi
    fi
    kill -0 "$make_pid" 2>/dev/null || { echo "make serve exited:"; tail -20 "$dest/make.log"; exit 1; }
    sleep 1
done
echo "no answer after an hour"
exit 1

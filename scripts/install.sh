#!/usr/bin/env bash
# The one install path of kvserve: the README, CI and the Dockerfiles all call this script.
#
#   scripts/install.sh [--test] [--deps-only]
#
#   --test        also install the test extras, and Debian's chromium + chromium-driver for the chat page's
#                 browser tests (with apt-get, when they are missing and this runs as root)
#   --deps-only   install torch and pyproject.toml's requirements but not kvserve itself: the Dockerfiles run
#                 this on pyproject.toml alone, so the dependency layer stays cached while the source changes
#
# Environment:
#   KVSERVE_VENV         virtualenv to create/use (default: .venv in the repository); set it empty ("")
#                        to install into the interpreter given by PYTHON instead (Docker images do).
#   PYTHON               interpreter used to create the venv, or to install into (default: python3)
#   TORCH_SPEC           the torch requirement (default: torch==2.13.0, the CPU wheel on these machines)
#   TORCH_INDEX_URL      where torch comes from elsewhere, e.g. https://download.pytorch.org/whl/cpu
#                        or https://download.pytorch.org/whl/cu128 (default: the configured index)
#   KVSERVE_KERNEL_TIERS which CPU tiers' kernels to build: auto (the default: the one tier a server here runs
#                        as), runnable (every tier this CPU runs), test (the default with --test: those, as
#                        the kernel tests run each, and the amx tier where only its tiles are missing, whose
#                        tile kernels the tests run on a software model of them), all (every tier of the
#                        platform, for an image that runs elsewhere), or names (avx2,generic)
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
deps_only=""
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]" ;;
        --deps-only) deps_only=1 ;;
        *) echo "usage: scripts/install.sh [--test] [--deps-only] (unknown: $arg)" >&2; exit 2 ;;
    esac
done
python="${PYTHON:-python3}"
venv="${KVSERVE_VENV-.venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"

if [ -n "$venv" ]; then
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    python="$venv/bin/python"
fi

pip=("$python" -m pip install --disable-pip-version-check --quiet --no-warn-script-location)
# torch first and on its own, so that no other requirement can pull a different (CUDA) build.
if ! "$python" -c "import torch" 2>/dev/null; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "${pip[@]}" --index-url "$TORCH_INDEX_URL" "$torch_spec"
    else
        "${pip[@]}" "$torch_spec"
    fi
fi
if [ -n "$deps_only" ]; then
    requirements=$("$python" - "$extras" <<'EOF'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]["test"] if sys.argv[1] else []
print("\n".join(project["dependencies"] + extras))
EOF
    )
    mapfile -t requirements <<<"$requirements"
    "${pip[@]}" "${requirements[@]}"
    echo "kvserve's dependencies installed into $("$python" -c 'import sys; print(sys.prefix)')"
else
    # pip resolving an unchanged install takes ~8 s: in the checkout's own venv, skip it while pyproject.toml
    # (and the extras asked for) are what that venv's last install saw
    stamp="${venv:+$venv/.kvserve-installed}"
    wanted="$(sha256sum pyproject.toml | cut -c1-16)$extras"
    installed="$(cat "$stamp" 2>/dev/null || true)"
    # The C++ CPU kernels (model/csrc) are compiled here (~75 s a tier on 2 cores; an edit recompiles only
    # the unit it touched) into this install's own folder: a server start never compiles. A server runs one tier,
    # so `make serve` waits for that one alone; the tests run every tier this CPU can (--test), and
    # KVSERVE_KERNEL_TIERS=all builds every tier of the platform (images that run on other hosts).
    # Without a C++ compiler this warns and kvserve runs PyTorch ops instead.
    tiers="${KVSERVE_KERNEL_TIERS:-$([ -n "$extras" ] && echo test || echo auto)}"
    if [ -z "$stamp" ] || { [ "$installed" != "$wanted" ] && [ "$installed" != "$wanted[test]" ]; }; then
        # The kernels need only torch and ninja: they compile (CPU) while pip fetches and unpacks the rest
        # (network, disk), a minute or more off a first `make serve`. A build that failed beside pip (a package
        # it imports being replaced) is tried again below; one that succeeded is not redone.
        "$python" -c "import ninja" 2>/dev/null || "${pip[@]}" "ninja>=1.11"
        "$python" -m model.kernels build --tiers "$tiers" >/dev/null 2>&1 &
        early_build=$!
        if ! "${pip[@]}" -e ".$extras"; then
            wait "$early_build" || true
            exit 1
        fi
        wait "$early_build" || true
        [ -z "$stamp" ] || echo "$wanted" >"$stamp"
    fi
    "$python" -m model.kernels build --tiers "$tiers"
    echo "kvserve installed into $("$python" -c 'import sys; print(sys.prefix)')"
fi
# The chat page's tests drive a real browser: Debian's Chromium through its own ChromeDriver (the pair always
# matches; nothing is downloaded from a browser vendor). ~1-2 minutes on a machine that has neither.
if [ -n "$extras" ] && ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing chromium and chromium-driver for the browser tests (apt-get)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
            || echo "warning: apt-get could not install chromium + chromium-driver: the browser tests will fail" >&2
    else
        echo "warning: /usr/bin/chromium or /usr/bin/chromedriver is missing and this is not root with apt-get:" \
            "the chat page's browser tests will fail until Debian's chromium and chromium-driver are installed" >&2
    fi
fi

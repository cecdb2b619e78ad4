#!/usr/bin/env bash
# The one install path of kvserve: the README, CI and the Dockerfiles all call this script.
#
#   scripts/install.sh [--test]
#
# Environment:
#   KVSERVE_VENV         virtualenv to create/use (default: .venv in the repository); set it empty ("")
#                        to install into the interpreter given by PYTHON instead (Docker images do).
#   PYTHON               interpreter used to create the venv, or to install into (default: python3)
#   TORCH_SPEC           the torch requirement (default: torch==2.13.0, the CPU wheel on these machines)
#   TORCH_INDEX_URL      where torch comes from elsewhere, e.g. https://download.pytorch.org/whl/cpu
#                        or https://download.pytorch.org/whl/cu128 (default: the configured index)
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
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
"${pip[@]}" -e ".$extras"
echo "kvserve installed into $("$python" -c 'import sys; print(sys.prefix)')"

#!/usr/bin/env bash
# kvserve's container images, built and run with whichever OCI engine this machine has:
# Docker when its daemon answers, else podman (installed with apt-get when neither is there and we are root).
#
#   scripts/image.sh build cpu|cuda [ENGINE BUILD ARGS...]   kvserve:cpu from docker/Dockerfile, or kvserve:cuda
#   scripts/image.sh compose [COMPOSE ARGS...]               compose on docker/compose.yaml with the same engine
#   scripts/image.sh engine                                   print the engine command, flags included
#   scripts/image.sh run-flags                                print the flags `run` and `build` need here
#   scripts/image.sh base IMAGE...                            make sure base images exist (pulled or stood in)
#
# `make image` / `make image-cuda` run `build`; tests/deploy/test_images.py runs all of them.
#
# Podman on hosts without systemd or with cgroup v1 (containers, CI sandboxes) needs
# `--cgroup-manager cgroupfs --runtime runc`, and `--ulimit nofile=... --ulimit nproc=...` within this
# shell's hard limits when those are below podman's defaults for root; the script adds exactly those.
#
# Offline base images. A base image (FROM) that is neither here nor pullable (Docker Hub unreachable) is
# replaced by a local stand-in tagged with its name, so the Dockerfiles build unchanged:
#   kvserve-offline/debian:bookworm  `debootstrap --variant=minbase bookworm` from the Debian mirror apt uses
#                                    here, imported with `<engine> import`
#   python:3.11-slim-bookworm        docker/offline/python.Containerfile: Debian's python3.11 (+ venv) on it
#   prom/prometheus:*                docker/offline/prometheus.Containerfile: Debian's prometheus (2.42) on it
#   nvidia/cuda:*                    the Debian base itself: no CUDA libraries (torch's CUDA wheels bring
#                                    theirs), apt gives Debian's Python 3.11 instead of Ubuntu's 3.12
# Stand-ins stay in the engine's image store, so only the first build on a machine makes them (~2-3 min).
#
# pip settings (podman only: `docker build` cannot mount host paths). When this host's pip configuration
# names local paths (a find-links folder, a file:// index, a constraints file, a CA bundle), a build's pip
# needs them too: the script writes the host's effective settings (`pip config list`, PIP_* included) into
# one pip.conf with those paths moved under /run/kvserve-pip/, and mounts, read-only into each RUN step, that
# file at /etc/pip.conf and each path at its new place (a file:// index with the folder above it, where its
# pages link). Here: /opt/wheels (the torch CPU wheel), /opt/pypi, /opt/pypi-more,
# /etc/xdg/pip/constraints.txt and the CA bundle of this sandbox's TLS proxy. Nothing of them lands in the
# image but podman 4.3's empty mount points (an empty /etc/pip.conf, empty entries in /run/kvserve-pip/).
# With a torch wheel among them, TORCH_INDEX_URL is set empty so that torch comes from there too (the same CPU
# wheel PyTorch's CPU index serves); for the CUDA image, folders holding a torch wheel are left out, and torch
# comes from PyPI's CUDA build.
#
# Environment:
#   KVSERVE_ENGINE      docker or podman (default: detected as above)
#   KVSERVE_IMAGE_PIP   host (mount this host's pip settings) or none (default: host when they name local paths)
#   TORCH_INDEX_URL, TORCH_SPEC   passed to the build as the Dockerfiles' build arguments when set
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_BASE=localhost/kvserve-offline/debian:bookworm
say() { echo "image.sh: $*" >&2; }
die() { say "$*"; exit "${2:-1}"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif sudo -n true 2>/dev/null; then sudo -n "$@"; else return 1; fi
}

apt_install() {
    command -v apt-get >/dev/null || return 1
    say "installing $* (apt-get)"
    local env=(env DEBIAN_FRONTEND=noninteractive)
    as_root "${env[@]}" apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 \
        || { as_root apt-get update >/dev/null 2>&1 && as_root "${env[@]}" apt-get install -y \
            --no-install-recommends "$@" >/dev/null; }
}

# The engine: one word, docker or podman. Exit status 3 means no engine can be had here.
detect_engine() {
    if [ -n "${KVSERVE_ENGINE:-}" ]; then
        echo "$KVSERVE_ENGINE"
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo docker
    elif command -v podman >/dev/null; then
        echo podman
    # runc: the runtime that works on cgroup v1; dnsname: compose services find each other by name on
    # podman's CNI networks.
    elif apt_install podman runc golang-github-containernetworking-plugin-dnsname && command -v podman >/dev/null
    then
        echo podman
    else
        die "no container engine: neither a running Docker nor podman, and podman cannot be installed here" 3
    fi
}

ENGINE=$(detect_engine)
engine=("$ENGINE")
run_flags=()
build_flags=()
if [ "$ENGINE" = podman ]; then
    # No systemd to delegate cgroups to: podman manages them itself.
    [ -d /run/systemd/system ] || engine+=(--cgroup-manager cgroupfs)
    # cgroup v1 (or hybrid): crun fails there, runc works.
    if [ ! -f /sys/fs/cgroup/cgroup.controllers ]; then
        command -v runc >/dev/null || apt_install runc || die "podman needs runc on cgroup v1"
        engine+=(--runtime runc)
    fi
    # Rootful podman gives containers nofile 1048576 and nproc 4194304; runc cannot set more than our hard
    # limits, and (measured in the CI sandbox) no nproc above the kernel's pid_max.
    pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 4194304)
    for limit in nofile:n:1048576:1048576 nproc:u:4194304:"$pid_max"; do
        IFS=: read -r name flag default cap <<<"$limit"
        hard=$(ulimit -H"$flag")
        [ "$hard" = unlimited ] && hard=$default
        [ "$hard" -gt "$cap" ] && hard=$cap
        [ "$hard" -lt "$default" ] && run_flags+=(--ulimit "$name=$hard:$hard")
    done
    # Docker's image format: podman's default (OCI) drops HEALTHCHECK, and `podman ps` would never say healthy.
    build_flags=(--format docker "${run_flags[@]}")
fi

full_name() {  # Docker's normalisation: python:3.11 -> docker.io/library/python:3.11
    local name=$1 first=${1%%/*}
    if [[ $name != */* ]]; then
        echo "docker.io/library/$name"
    elif [[ $first == *.* || $first == *:* || $first == localhost ]]; then
        echo "$name"
    else
        echo "docker.io/$name"
    fi
}

have_image() { "${engine[@]}" image inspect "$1" >/dev/null 2>&1; }

# The Debian mirror and security mirror apt uses on this host (deb822 sources, then sources.list).
apt_uri() {
    local suite=$1 uri
    uri=$(awk -v s="$suite" '/^$/ {u=""} /^URIs:/ {u=$2}
        /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == s && u != "") {print u; exit}}' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
    [ -n "$uri" ] || uri=$(awk -v s="$suite" '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i == s) {print $(i-1); exit}}' \
        /etc/apt/sources.list 2>/dev/null | head -n1)
    echo "$uri"
}

make_debian_base() {
    have_image "$DEBIAN_BASE" && return
    command -v debootstrap >/dev/null || apt_install debootstrap || die "the offline base needs debootstrap"
    local mirror security root
    mirror=$(apt_uri bookworm)
    mirror=${mirror:-http://deb.debian.org/debian}
    security=$(apt_uri bookworm-security)
    security=${security:-http://deb.debian.org/debian-security}
    root=$(mktemp -d /var/tmp/kvserve-debian.XXXXXX)
    say "making $DEBIAN_BASE: debootstrap --variant=minbase bookworm from $mirror (1-2 min)"
    as_root debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 \
        || { tail -n 20 "$root.log" >&2; as_root rm -rf "$root" "$root.log"; die "debootstrap failed"; }
    # Sources as Debian's own images have them; no package lists or .debs in the image.
    as_root rm -f "$root/etc/apt/sources.list"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: %s\n\nTypes: deb\nURIs: %s\nSuites: bookworm-security\nComponents: main\nSigned-By: %s\n' \
        "$mirror" /usr/share/keyrings/debian-archive-keyring.gpg "$security" \
        /usr/share/keyrings/debian-archive-keyring.gpg | as_root tee "$root/etc/apt/sources.list.d/debian.sources" >/dev/null
    as_root sh -c "rm -rf '$root'/var/lib/apt/lists/* '$root'/var/cache/apt/*.bin '$root'/var/cache/apt/archives/*.deb"
    as_root tar -C "$root" -c . | "${engine[@]}" import - "$DEBIAN_BASE" >/dev/null
    as_root rm -rf "$root" "$root.log"
}

# A stand-in is labelled with its Containerfile's hash, so that editing the file rebuilds it.
standin_file() {
    case "$1" in
        docker.io/library/python:3.11-slim-bookworm) echo docker/offline/python.Containerfile ;;
        docker.io/prom/prometheus:*) echo docker/offline/prometheus.Containerfile ;;
    esac
}

standin_build() {  # standin_build CONTAINERFILE NAME
    make_debian_base
    say "making the stand-in $2 from $1"
    "${engine[@]}" build "${build_flags[@]}" --label "kvserve.standin=$(sha256sum <"$1" | cut -c1-16)" \
        -f "$1" -t "$2" docker/offline >&2
}

# Make sure an image exists: here already, pulled, or replaced by a local stand-in of the same name.
ensure_base() {
    local name full file label
    name=$1
    full=$(full_name "$name")
    file=$(standin_file "$full")
    if have_image "$full"; then
        label=$("${engine[@]}" image inspect --format '{{index .Labels "kvserve.standin"}}' "$full" 2>/dev/null)
        if [ -z "$label" ] || [ "$label" = "<no value>" ] || [ -z "$file" ] \
            || [ "$label" = "$(sha256sum <"$file" | cut -c1-16)" ]; then
            return
        fi
        say "$file changed since $full was made"
        standin_build "$file" "$full"
        return
    fi
    say "pulling $full"
    timeout 900 "${engine[@]}" pull "$full" >&2 && return
    say "cannot pull $full: using an offline stand-in"
    if [ -n "$file" ]; then
        standin_build "$file" "$full"
    elif [[ $full == docker.io/nvidia/cuda:* ]]; then
        make_debian_base
        "${engine[@]}" tag "$DEBIAN_BASE" "$full"
    else
        die "cannot pull $full and there is no offline stand-in for it"
    fi
}

# pip settings for the build (see the top): writes the pip.conf, prints `-v` values (SRC:DST:ro), one a line,
# and creates CONF.torch when torch should come from them (TORCH_INDEX_URL empty). Prints nothing when the
# host's settings name no local path: then the Dockerfile's own sources serve.
pip_mounts() {  # pip_mounts CONF_PATH cpu|cuda
    "${PYTHON:-python3}" - "$1" "$2" <<'EOF'
import ast
import configparser
import glob
import os
import subprocess
import sys
from urllib.parse import urlparse

conf_path, flavour = sys.argv[1], sys.argv[2]
listing = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
).stdout.splitlines()
# pip's precedence: files first, then PIP_* (listed as ":env:"), which override them.
listing.sort(key=lambda line: line.startswith(":env:"))
config = configparser.ConfigParser(interpolation=None)
for line in listing:
    name, _, value = line.partition("=")
    section, _, key = name.rpartition(".")
    section = "global" if section in ("", ":env:") else section
    if not config.has_section(section):
        config.add_section(section)
    config[section][key] = ast.literal_eval(value)


def local_path(token):
    path = urlparse(token).path if token.startswith("file:") else token
    return path if path.startswith("/") and os.path.exists(path) else None


# Every local path is mounted under one folder, so that no file of the image is shadowed (a CA bundle mounted
# over /etc/ssl/certs/ca-certificates.crt breaks the ca-certificates package's install) and podman's empty
# mount points stay there.
ROOT = "/run/kvserve-pip"
mounts, torch_local = {}, False


def mounted(path):
    if path not in mounts:
        mounts[path] = f"{ROOT}/{len(mounts)}-{os.path.basename(path.rstrip('/'))}"
    return mounts[path]


for section in config.sections():
    for key in ("find-links", "index-url", "extra-index-url", "constraint", "requirement", "cert", "client-cert"):
        if key not in config[section]:
            continue
        kept = []
        for token in config[section][key].split():
            path = local_path(token)
            if path is None:
                kept.append(token)
                continue
            has_torch = bool(glob.glob(os.path.join(path, "torch-*.whl")))
            if has_torch and flavour == "cuda":
                continue  # a local (CPU) torch would win over the CUDA build
            torch_local |= has_torch
            if key.endswith("index-url"):
                # A local index's pages link to its files relatively (../../files/...): mount its parent.
                parent, name = os.path.split(path.rstrip("/"))
                kept.append(f"file://{mounted(parent)}/{name}")
            else:
                kept.append(mounted(path))
        config[section][key] = " ".join(kept)
if not mounts:
    sys.exit(0)
with open(conf_path, "w") as f:
    config.write(f)
print(f"{conf_path}:/etc/pip.conf:ro")
for path, target in mounts.items():
    print(f"{path}:{target}:ro")
if torch_local or flavour == "cuda":
    open(conf_path + ".torch", "w").close()
EOF
}

# pip_args: the `-v` and `--build-arg` flags that give a podman build this host's pip settings.
pip_args=()
pip_build_args() {  # pip_build_args cpu|cuda
    pip_args=()
    if [ "$ENGINE" = docker ]; then
        [ "${KVSERVE_IMAGE_PIP:-}" != host ] \
            || say "docker build cannot mount this host's pip settings: the Dockerfile's own sources are used"
        return
    fi
    [ "${KVSERVE_IMAGE_PIP:-host}" = host ] || return 0
    local mounts m
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mapfile -t mounts < <(pip_mounts "$tmp/pip.conf" "$1")
    [ "${#mounts[@]}" -gt 0 ] || return 0
    say "this host's pip settings, mounted read-only into the build: ${mounts[*]}"
    for m in "${mounts[@]}"; do pip_args+=(-v "$m"); done
    # Torch from those settings too, unless the caller named an index.
    if [ -e "$tmp/pip.conf.torch" ] && [ -z "${TORCH_INDEX_URL+set}" ]; then
        pip_args+=(--build-arg TORCH_INDEX_URL=)
    fi
}

build() {
    local flavour=${1:-cpu}
    shift || true
    local dockerfile tag
    case "$flavour" in
        cpu) dockerfile=docker/Dockerfile tag=kvserve:cpu ;;
        cuda) dockerfile=docker/Dockerfile.cuda tag=kvserve:cuda ;;
        *) die "usage: scripts/image.sh build cpu|cuda [build args...]" 2 ;;
    esac
    local base
    for base in $(awk 'toupper($1) == "FROM" {print $2}' "$dockerfile"); do
        ensure_base "$base"
    done

    pip_build_args "$flavour"
    local args=("${build_flags[@]}" "${pip_args[@]}" -f "$dockerfile" -t "$tag")
    [ -n "${TORCH_SPEC:-}" ] && args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC")
    [ -n "${TORCH_INDEX_URL+set}" ] && args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    say "${engine[*]} build ${args[*]} $* ."
    local start=$SECONDS
    "${engine[@]}" build "${args[@]}" "$@" .
    say "built $tag in $((SECONDS - start)) s"
}

compose() {
    local prometheus
    prometheus=$(awk '/^ *image: *prom\/prometheus:/ {print $2}' docker/compose.yaml)
    [ -z "$prometheus" ] || ensure_base "$prometheus"
    if [ "$ENGINE" = docker ]; then
        exec docker compose -f docker/compose.yaml "$@"
    fi
    # podman-compose comes from PyPI with the test extras (.venv), or from PATH.
    local tool
    tool=$(command -v podman-compose || true)
    [ -n "$tool" ] || [ ! -x "${KVSERVE_VENV:-.venv}/bin/podman-compose" ] || tool="${KVSERVE_VENV:-.venv}/bin/podman-compose"
    [ -n "$tool" ] || die "podman-compose is missing: pip install podman-compose (in the test extras)"
    # `compose up --build` / `compose build` get the CPU image's build settings (see build above).
    pip_build_args cpu
    "$tool" --podman-args "${engine[*]:1}" --podman-run-args "${run_flags[*]}" \
        --podman-build-args "${build_flags[*]} ${pip_args[*]}" -f docker/compose.yaml "$@"
}

case "${1:-}" in
    build) shift; build "$@" ;;
    compose) shift; compose "$@" ;;
    engine) echo "${engine[*]}" ;;
    run-flags) echo "${run_flags[*]}" ;;
    base) shift; for image in "$@"; do ensure_base "$image"; done ;;
    *) die "usage: scripts/image.sh build cpu|cuda | compose ARGS | engine | run-flags | base IMAGE..." 2 ;;
esac

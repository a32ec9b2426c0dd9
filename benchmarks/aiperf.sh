#!/usr/bin/env bash
# NVIDIA AIPerf (a client nobody here wrote) against the OpenAI endpoint, in three phases:
#   mooncake_pass1  the first 40 records of ../shared/data/mooncake/synthetic_trace.jsonl, inputs scaled down 16x,
#                   on their own arrival schedule (--fixed-schedule), streamed;
#   mooncake_pass2  the identical replay: its prompts should come from the cache (cached share, TTFT vs pass 1);
#   multiturn_chat  synthetic multi-turn chat conversations at concurrency 4.
# With KVCLUSTER_URL set it measures that endpoint; otherwise it starts the main job (README's first command,
# its state purged first) and stops it at the end. AIPerf lives in its own venv (.venv-aiperf, ~1.2 GB).
#
#   bash benchmarks/aiperf.sh [--json]        # figures (JSON only with --json); artifacts under $AIPERF_OUT
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${AIPERF_OUT:-/tmp/kvcluster-aiperf}
JSON=${1:-}
log() { [ "$JSON" = "--json" ] && echo "$@" >&2 || echo "$@"; }
if [ ! -x .venv-aiperf/bin/aiperf ]; then
  log "installing aiperf 0.13.0 into .venv-aiperf"
  "${PYTHON:-python3.11}" -m venv .venv-aiperf
  .venv-aiperf/bin/pip install -q --disable-pip-version-check aiperf==0.13.0 >&2
fi
rm -rf "$OUT" && mkdir -p "$OUT"
inputs=$(.venv/bin/python benchmarks/aiperf_support.py inputs "$OUT")
trace=$(echo "$inputs" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["mooncake"])')
export HF_HOME="$OUT/hf" HF_HUB_OFFLINE=1
URL=${KVCLUSTER_URL:-}
server=""
if [ -z "$URL" ]; then
  URL=http://127.0.0.1:8000
  .venv/bin/kvcluster cluster down local --purge --address 127.0.0.1:9 >&2  # no Ray yet: only the files go
  RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1 setsid .venv/bin/serve run configs/serve_runner.yaml > "$OUT/server.log" 2>&1 &
  server=$!
  trap 'kill -TERM -- -$server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
  for _ in $(seq 1 150); do curl -sf "$URL/v1/models" >/dev/null && break; sleep 2; done
fi
curl -sf "$URL/v1/models" >/dev/null || { echo "no endpoint answers at $URL" >&2; exit 1; }
common=(--model kvcluster-tiny-llama --tokenizer local/kvcluster-tiny-llama --url "$URL" --streaming --no-auto-plot)
for pass in 1 2; do
  log "phase mooncake_pass$pass"
  .venv-aiperf/bin/aiperf profile "${common[@]}" --endpoint-type completions --input-file "$trace" \
    --custom-dataset-type mooncake_trace --prompt-input-tokens-block-size 32 --fixed-schedule \
    --output-artifact-dir "$OUT/mooncake_pass$pass" > "$OUT/mooncake_pass$pass.log" 2>&1
done
log "phase multiturn_chat"
.venv-aiperf/bin/aiperf profile "${common[@]}" --endpoint-type chat --conversation-num 8 --conversation-turn-mean 3 \
  --prompt-input-tokens-mean 256 --prompt-output-tokens-mean 8 --concurrency 4 --random-seed 1 \
  --output-artifact-dir "$OUT/multiturn_chat" > "$OUT/multiturn_chat.log" 2>&1
.venv/bin/python benchmarks/aiperf_support.py summary "$OUT" $JSON

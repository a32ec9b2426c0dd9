#!/usr/bin/env bash
# GPU check (issue 9): one command, one JSON report, a short summary, under 8 minutes on one GPU.
#
#   benchmarks/gpu_check.sh              on a CUDA machine; without one it says so in one line and exits 0
#   benchmarks/gpu_check.sh --dry-run    the same code on the CPU with a tiny model (also GPU_CHECK_DRY=1);
#                                        every figure is labelled "cpu (dry run, not a GPU result)"
#   extra arguments go to gpu_check.py (--only hbm,serving  --out PATH)
#
# Report: $GPU_CHECK_JSON, else $OUT/gpu_check.json when OUT is set, else benchmarks/gpu_check.json.
# Python: $GPU_CHECK_PYTHON, else the first of .venv/bin/python, /opt/torch/.venv/bin/python3 and python3
# whose torch sees a CUDA device. The repo goes on PYTHONPATH; nothing is installed from a network.
#
# First the machine is prepared: the wheels the GPU image lacks (pydantic for the runner, nixl; optionally
# kvikio) travel in benchmarks/gpu_wheels/ (or $GPU_CHECK_WHEELS) and scripts/prepare_gpu_machine.py installs
# them offline into a temp dir on PYTHONPATH. Fill that folder on a machine with a registry, then name it in
# the device tool's carry (large wheels are recompressed with LZMA to fit the 64 MiB carry):
#   echo /benchmarks/gpu_wheels/ >> .git/info/exclude          # never committed
#   .venv/bin/python scripts/prepare_gpu_machine.py fetch benchmarks/gpu_wheels [--with-kvikio]
# Then the benchmark: benchmarks/gpu_check.py with the sections in benchmarks/gpu_*.py.
#
# Exit status: 0 when the check ran to its end (failed sections are in the report) or there is no CUDA;
# 124 when the hard time limit stopped it (the report holds the sections done); other: it could not start.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
limit="${GPU_CHECK_LIMIT_S:-470}"  # the whole run, wheel install included, stays under 8 minutes
dry=0
args=()
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
[ "${GPU_CHECK_DRY:-0}" = 1 ] && dry=1

candidates=()
[ -n "${GPU_CHECK_PYTHON:-}" ] && candidates+=("$(command -v "$GPU_CHECK_PYTHON" || echo "$GPU_CHECK_PYTHON")")
candidates+=("$root/.venv/bin/python" /opt/torch/.venv/bin/python3)
command -v python3 >/dev/null 2>&1 && candidates+=("$(command -v python3)")

probe() {  # $1 python, $2 python expression that must be true
  [ -x "$1" ] && "$1" -c "import sys, torch; sys.exit(0 if ($2) else 1)" >/dev/null 2>&1
}

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=""
if [ "$dry" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" GPU_CHECK_DRY=1
  for c in "${candidates[@]}"; do probe "$c" True && { py="$c"; break; }; done
  [ -n "$py" ] || { echo "gpu_check: no python with torch found for the dry run (tried ${candidates[*]})"; exit 2; }
  exec "$py" "$here/gpu_check.py" --dry-run "${args[@]+"${args[@]}"}"
fi

for c in "${candidates[@]}"; do probe "$c" "torch.cuda.is_available()" && { py="$c"; break; }; done
if [ -z "$py" ]; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check"
  exit 0
fi

wheels="${GPU_CHECK_WHEELS:-$here/gpu_wheels}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  site="${TMPDIR:-/tmp}/kvcluster-gpu-check-site"
  if installed="$("$py" "$root/scripts/prepare_gpu_machine.py" install "$wheels" --target "$site")"; then
    export PYTHONPATH="$root:$site${PYTHONPATH#"$root"}"
    export GPU_CHECK_WHEELS_INSTALLED="$installed"
  else
    echo "gpu_check: going on without the wheels in $wheels"
  fi
fi

# The tiers' checksum kernel (kvcluster.storage._copyhash) is built per Python; without it every verified copy
# falls back to numpy and the tier figures would measure that instead. Built in place for this Python (seconds).
kernel() { "$py" -c "from kvcluster.storage.copyhash import KERNEL; print(KERNEL)" 2>/dev/null; }
if [ "$(kernel)" = python ]; then
  (cd "$root" && "$py" setup.py -q build_ext --inplace --build-temp "${TMPDIR:-/tmp}/kvcluster-gpu-check-build") \
    >"${TMPDIR:-/tmp}/kvcluster-gpu-check-build.log" 2>&1 \
    || echo "gpu_check: building the checksum kernel failed (log ${TMPDIR:-/tmp}/kvcluster-gpu-check-build.log)"
fi
export GPU_CHECK_CHECKSUM_KERNEL="$(kernel)"

left=$(( limit - SECONDS ))
timeout -k 10 "$left" "$py" "$here/gpu_check.py" "${args[@]+"${args[@]}"}"
rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "gpu_check: stopped at the ${limit} s limit; the report holds the sections that finished"
  exit 124
fi
exit "$rc"

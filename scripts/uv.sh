# Sourced by scripts/setup.sh and scripts/setup_vllm.sh (from the repo root): `uv_install VENV ARGS...` is
# `pip install ARGS...` into VENV, done by uv. On the 2-core CI machine a fresh setup of both venvs took 401 s
# with pip, one after the other, nearly all of it pip's own CPU (resolving, unpacking, compiling every module to
# bytecode, one download at a time); with uv, the venvs built side by side, 64 s with an empty download cache
# and 49 s with a warm one (the same packages and versions: `uv pip compile` resolves both lists as pip did).
#
# uv is a pinned release from PyPI, installed once with pip into .cache/ (git-ignored). uv does not read
# pip's configuration, so the find-links, index URLs and constraint files pip is configured with (pip.conf,
# PIP_* variables) are handed to it here: the local wheel directory is where torch==2.13.0+cpu comes from (the
# registry's torch 2.13.0 is a CUDA build), so without it torch would not resolve, or would resolve to CUDA.
# `--index-strategy unsafe-best-match` is pip's rule (the best version across every index); uv's default takes
# a package from the first index that has it, and the local indexes hold older releases (ray 2.58).
# Bytecode is not compiled at install time (pip compiles every module of torch, ray and vLLM; Python compiles
# only what is imported, once, on first import, unless PYTHONDONTWRITEBYTECODE is set: .ci/run and the test
# suite unset it for what they start). UV_CACHE_DIR, when set, is uv's download cache.
UV_VERSION=0.13.9
UV_DIR=.cache/uv-$UV_VERSION
UV="$UV_DIR/bin/uv"

uv_bootstrap() {  # $1: the python to run pip with
  if [ -x "$UV" ] && [ "$("$UV" --version 2>/dev/null)" = "uv $UV_VERSION" ]; then
    return
  fi
  local tmp
  tmp=$(mktemp -d .cache/uv-install.XXXXXX 2>/dev/null || { mkdir -p .cache && mktemp -d .cache/uv-install.XXXXXX; })
  "$1" -m pip install -q --disable-pip-version-check --root-user-action=ignore --target "$tmp" "uv==$UV_VERSION"
  rm -rf "$UV_DIR"
  mv "$tmp" "$UV_DIR" 2>/dev/null || rm -rf "$tmp"  # a concurrent setup may have put it there first
  "$UV" --version >/dev/null
}

uv_pip_flags() {  # $1: the python whose pip configuration to follow; prints one uv flag per line
  local line key value
  declare -A conf=() from_env=()
  while IFS= read -r line; do  # e.g. global.find-links='/opt/wheels'; a PIP_* variable (:env:) wins
    key=${line%%=*}
    value=${line#*=}
    value=${value#\'}
    value=${value%\'}
    case "$key" in
      :env:.*) key=${key#:env:.}; conf[$key]=$value; from_env[$key]=1 ;;
      global.* | install.*) key=${key#*.}; [ -n "${from_env[$key]:-}" ] || conf[$key]=$value ;;
    esac
  done < <("$1" -m pip config list 2>/dev/null)
  local v
  for v in ${conf[index-url]:-}; do printf '%s\n' --index-url "$v"; done
  for v in ${conf[extra-index-url]:-}; do printf '%s\n' --extra-index-url "$v"; done
  for v in ${conf[find-links]:-}; do printf '%s\n' --find-links "$v"; done
  for v in ${conf[constraint]:-}; do printf '%s\n' --constraint "$v"; done
  printf '%s\n' --index-strategy unsafe-best-match
}

uv_install() {  # $1: the venv; the rest: pip install's arguments
  local venv=$1
  shift
  if [ -z "${UV_PIP_FLAGS+x}" ]; then
    mapfile -t UV_PIP_FLAGS < <(uv_pip_flags "$venv/bin/python")
  fi
  local t0=${EPOCHREALTIME/./} dt
  "$UV" pip install -q --python "$venv/bin/python" "${UV_PIP_FLAGS[@]}" "$@"
  dt=$(( (${EPOCHREALTIME/./} - t0) / 100000 ))
  echo "setup: $venv: installed ${*: -1} in $((dt / 10)).$((dt % 10)) s" >&2
}

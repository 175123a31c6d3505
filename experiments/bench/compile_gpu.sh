#!/bin/bash
# On a lent GPU (H200: the 0.6B/micro-batch-16 row needs ~83 GiB): trainer.compile off vs on in ONE run.
#   mfu — update-phase tokens/s and MFU, Qwen3-0.6B (micro-batch 16) and 1.7B (8) shapes, no activation checkpointing
#   trl — a full iteration, TRL's GRPOTrainer (defaults) vs gearlab static-cache rollouts, eager vs compiled update
# Usage: bash experiments/bench/compile_gpu.sh mfu trl   (carry .whl = omegaconf, .trlw = TRL and its wheels)
set -uo pipefail
python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
for part in "$@"; do
  if [[ $part == mfu ]]; then
    for sm in "qwen3-0.6b 16" "qwen3-1.7b 8"; do
      set -- $sm
      for c in 0 1; do
        timeout 300 python experiments/bench/update_mfu.py --shape "$1" --micro-batch "$2" --checkpointing 0 --chunk-size 4096 \
          --compile $c --iters 3 --out "$OUT/mfu_$1_compile$c.json" > "$OUT/mfu_$1_compile$c.log" 2>&1 \
          && grep '^{' "$OUT/mfu_$1_compile$c.log" | cut -c1-400 || tail -5 "$OUT/mfu_$1_compile$c.log"
      done
    done
  fi
  if [[ $part == trl ]]; then
    python -m pip install -q --no-deps .trlw/*.whl 2>&1 | grep -v WARNING | tail -1
    timeout 420 python experiments/bench/trl_vs_gearlab.py --iters 4 --variants trl,gearlab_static,gearlab_static_compiled \
      --out "$OUT/trl_vs_gearlab_compile.json" > "$OUT/trl.log" 2>&1; tail -c 1500 "$OUT/trl.log"
  fi
done

#!/bin/bash
# Issue 8 on a lent 4-GPU (or 8-GPU) host: FSDP2 update scaling for the Qwen3-4B / 8B shapes, then full GEAR
# iterations. Results land in $OUT (or ./gpu_out). Usage: bash experiments/bench/scaling_gpus.sh update|gear [max_gpus]
set -uo pipefail
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v "WARNING: Running pip" | tail -1; python -c "import omegaconf, yaml" || exit 3
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
part="${1:-update}"; max="${2:-4}"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>/dev/null
counts=(1 2 4 8)
if [[ "$part" == update ]]; then
  # same global batch at every GPU count: 8 prompts × 8 = 64 sequences of 2,048 tokens, micro-batch 4, act. ckpt
  for shape in qwen3-4b qwen3-8b; do for d in "${counts[@]}"; do
    (( d > max )) && continue
    [[ $shape == qwen3-8b && $d == 1 ]] && continue  # 16 B/param × 8.2 B = 131 GB of states: does not fit one card
    timeout 170 python experiments/bench/update_mfu.py --shape $shape --devices $d --prompts 8 --micro-batch 4 --iters 2 \
      --out "$OUT/upd_${shape}_d${d}.json" > "$OUT/upd_${shape}_d${d}.log" 2>&1 && grep '^{' "$OUT/upd_${shape}_d${d}.log" \
      || { echo "$shape d$d failed"; grep -m3 -E "Error|error|Killed" "$OUT/upd_${shape}_d${d}.log"; }
  done; done
fi
if [[ "$part" == gear ]]; then
  for d in "${counts[@]}"; do
    (( d > max )) && continue
    timeout 200 python experiments/bench/gear_iteration.py --shape qwen3-4b --devices $d --iters 3 \
      --out "$OUT/gear_qwen3-4b_d${d}.json" > "$OUT/gear_d${d}.log" 2>&1 && grep '^{' "$OUT/gear_d${d}.log" \
      || { echo "gear d$d failed"; grep -m3 -E "Error|error|Killed" "$OUT/gear_d${d}.log"; }
  done
fi

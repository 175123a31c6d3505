#!/bin/bash
# On a lent 2-GPU machine (device tool): 1-vs-2-GPU parity with NCCL (ddp, fsdp2, fsdp1), then the update
# MFU benchmark. Results land in $OUT (or ./gpu_out). Usage: bash experiments/bench/gpu_parity_and_mfu.sh [part]
set -uo pipefail
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v "WARNING: Running pip" | tail -1; python -c "import omegaconf, yaml" || exit 3
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
part="${1:-all}"
if [[ "$part" == all || "$part" == parity ]]; then
  python tests/parallel/parity_script.py "$OUT/p1.pt" 1 auto token-mean 8 gpu > "$OUT/p1.log" 2>&1 || tail -5 "$OUT/p1.log"
  for s in fsdp2 ddp fsdp1; do
    python tests/parallel/parity_script.py "$OUT/p2_$s.pt" 2 $s token-mean 3 gpu > "$OUT/p2_$s.log" 2>&1 || tail -5 "$OUT/p2_$s.log"
  done
  python - "$OUT" <<'PY'
import sys, torch, json
out = sys.argv[1]
ref = torch.load(f"{out}/p1.pt")
res = {}
for s in ("fsdp2", "ddp", "fsdp1"):
    try:
        g = torch.load(f"{out}/p2_{s}.pt")
    except FileNotFoundError:
        res[s] = "did not run"; continue
    rel = max(((g["grads"][k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() for k, v in ref["grads"].items())
    res[s] = {"loss_1gpu": ref["loss"], "loss_2gpu": g["loss"], "max_rel_grad_diff": rel,
              "pass": abs(g["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]) and rel < 1e-4}
print(json.dumps(res, indent=1)); open(f"{out}/parity.json", "w").write(json.dumps(res, indent=1))
PY
fi
if [[ "$part" == all || "$part" == mfu06 ]]; then
  for d in 1 2; do for mb in 4 8; do
    python experiments/bench/update_mfu.py --shape qwen3-0.6b --devices $d --micro-batch $mb --out "$OUT/mfu_0.6b_d${d}_mb${mb}.json" 2>&1 | grep '^{' || echo "0.6b d$d mb$mb failed"
  done; done
fi
if [[ "$part" == all || "$part" == mfu17 ]]; then
  for d in 1 2; do
    python experiments/bench/update_mfu.py --shape qwen3-1.7b --devices $d --micro-batch 4 --out "$OUT/mfu_1.7b_d${d}_mb4.json" 2>&1 | grep '^{' || echo "1.7b d$d failed"
  done
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>/dev/null

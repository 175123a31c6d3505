#!/bin/bash
# On a lent 2-GPU machine: 1-vs-2-GPU parity (ddp, fsdp2, fsdp1; padded and packed), then full GEAR iterations
# on the Qwen3-0.6B shape under fsdp1 and fsdp2. Usage: bash experiments/bench/fsdp1_gpu.sh [parity|packed|gear]...
set -uo pipefail
python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
for part in "$@"; do
  if [[ $part == parity ]]; then bash experiments/bench/gpu_parity_and_mfu.sh parity 2>&1 | tail -30; fi
  if [[ $part == packed ]]; then
    python tests/parallel/parity_script.py "$OUT/q1.pt" 1 auto token-mean 8 gpu > /dev/null 2>&1
    for s in fsdp2 fsdp1; do
      python tests/parallel/parity_script.py "$OUT/q2_$s.pt" 2 $s token-mean 3 gpu packed > "$OUT/q2_$s.log" 2>&1 || tail -3 "$OUT/q2_$s.log"
    done
    python - "$OUT" <<'PY'
import sys, torch
o = sys.argv[1]; ref = torch.load(f"{o}/q1.pt")
for s in ("fsdp2", "fsdp1"):
    g = torch.load(f"{o}/q2_{s}.pt")
    rel = max(((g["grads"][k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() for k, v in ref["grads"].items())
    print(f"packed {s} 2 GPUs vs padded 1 GPU: loss {g['loss']:.8f} vs {ref['loss']:.8f}, max rel grad diff {rel:.2e}")
PY
    rm -f "$OUT"/q*.pt
  fi
  if [[ $part == resume ]]; then
    for s in fsdp1 fsdp2; do
      R="$OUT/resume_$s"; mkdir -p "$R"
      python tests/parallel/resume_script.py "$R" $s init
      for ph in full stop resume; do
        timeout 150 python tests/parallel/resume_script.py "$R" $s $ph > "$R/$ph.log" 2>&1 || { echo "$s $ph failed"; grep -B2 -A3 -m3 Error "$R/$ph.log" | tail -12; }
      done
      grep -h -m1 "resuming from" "$R/resume.log" | cut -c1-120
      python tests/parallel/resume_script.py "$R" $s compare
      rm -rf "$R"
    done
  fi
  if [[ $part == gear ]]; then
    for s in fsdp1 fsdp2; do
      timeout 200 python experiments/bench/gear_iteration.py --shape qwen3-0.6b --devices 2 --strategy $s --iters 3 --new 128 \
        --out $OUT/gear_06b_$s.json > $OUT/gear_$s.log 2>&1 && grep '^{' $OUT/gear_$s.log \
        || { echo "gear $s failed"; grep -B2 -A3 -m3 -E "Error" $OUT/gear_$s.log | tail -20; }
    done
  fi
done

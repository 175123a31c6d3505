#!/bin/bash
# The fast decode path (rollout.engine=fast) on a lent GPU, in calls of at most 10 minutes (issue 19):
#   bash experiments/gpu/fast_decode_gpu.sh check   # ~4 min: experiments/gpu/fast_decode_check.py (correctness on the
#                                                   # GPU, decode ms/step of HF static+compiled vs fast eager/graphs)
#   bash experiments/gpu/fast_decode_gpu.sh bench   # ~6 min: the TRL-vs-gearlab table, each variant in its own process
#   bash experiments/gpu/fast_decode_gpu.sh varlen  # ~8 min: 50 iterations of a real run whose responses vary in
#                                                   # length (embedded:small-arith, engine=fast, trainer.compile)
# Carry .whl (gearlab's wheels the image lacks) and, for bench, .trlw (TRL and datasets): experiments/gpu/wheels.sh.
# Results land in $OUT; name the card (nvidia-smi's line is printed first) next to every number you copy.
set -uo pipefail
python -c "import mlflow, omegaconf" 2>/dev/null || python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
python -c "import gearlab.assigners" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in "$@"; do
  case $part in
  check)
    timeout 300 python experiments/gpu/fast_decode_check.py --out "$OUT/fast_decode_check.json" > "$OUT/check.log" 2>&1
    echo "check rc=$?"; tail -c 2500 "$OUT/check.log" ;;
  bench)
    python -c "import trl" 2>/dev/null || python -m pip install -q --no-deps .trlw/*.whl 2>&1 | grep -v WARNING | tail -1
    timeout 560 python experiments/bench/trl_vs_gearlab.py --iters 4 --profile \
      --variants trl_default,trl_tuned,gearlab_tuned,gearlab_fast \
      --out "$OUT/trl_vs_gearlab_tuned_h200.json" --md "$OUT/trl_vs_gearlab_tuned_h200.md" > "$OUT/bench.log" 2>&1
    echo "bench rc=$?"; cat "$OUT/trl_vs_gearlab_tuned_h200.md" 2>/dev/null; tail -c 1500 "$OUT/bench.log" ;;
  varlen)
    timeout 540 gearlab train model.name_or_path=embedded:small-arith task.name=arith_hard rollout.engine=fast \
      trainer.compile=true trainer.accelerator=gpu trainer.max_steps=50 trainer.output_dir=runs/varlen \
      rollout.max_new_tokens=96 eval.num_problems=64 trainer.progress_bar=false > "$OUT/varlen.log" 2>&1
    echo "varlen rc=$?"
    python experiments/gpu/varlen_summary.py runs/varlen > "$OUT/varlen_summary.json"; cat "$OUT/varlen_summary.json" ;;
  *) echo "unknown part $part (check | bench | varlen)"; exit 2 ;;
  esac
done

#!/bin/bash
# Calibration of conf/experiment/arith_long_gpu.yaml on one lent GPU (issue 17): warm-start lengths and RL learning
# rates, before the paired comparison. Carry .whl (omegaconf, mlflow and the mlflow deps the image lacks).
#   bash experiments/gpu/arith_long_calibrate.sh "600 2000" "1e-5 3e-5" 30
set -uo pipefail
python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
WS_STEPS=${1:-600}; LRS=${2:-1e-5}; ITERS=${3:-30}; W=$(mktemp -d)
for s in $WS_STEPS; do
  /usr/bin/time -f "warmstart $s steps: %e s" gearlab warmstart experiment=arith_long_gpu warmstart.steps=$s \
    trainer.output_dir=$W/ws$s > "$OUT/ws$s.log" 2>&1; tail -1 "$OUT/ws$s.log"
  cp $W/ws$s/embedded/small-arith/warmstart.json "$OUT/ws$s.json"; python -c "import json;d=json.load(open('$OUT/ws$s.json'));print({k:d[k] for k in ('steps','train_seconds','acc_plain_greedy','acc_plain_sampled','acc_privileged_greedy')})"
done
first=$(echo $WS_STEPS | cut -d' ' -f1)
for lr in $LRS; do
  ( gearlab train experiment=arith_long_gpu model.name_or_path=$W/ws$first/embedded/small-arith optim.lr=$lr \
      trainer.max_steps=$ITERS trainer.eval_every=10 eval.num_problems=200 credit_eval.after_training=false \
      trainer.output_dir=$W/tr$lr > "$OUT/train_lr$lr.log" 2>&1; echo "train lr=$lr rc=$?" ) &
done
wait
python experiments/gpu/rl_histories.py "$OUT/calibration.json" /tr "$W/tr*/mlflow.db" eval/avg@4 \
  eval/greedy_accuracy train/reward time/rollout_s time/update_s train/response_len

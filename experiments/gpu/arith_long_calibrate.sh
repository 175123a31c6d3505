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
python - "$W" "$OUT" <<'PY'
import glob, json, sys
import mlflow
w, out = sys.argv[1:]
rows = {}
for db in sorted(glob.glob(f"{w}/tr*/mlflow.db")):
    c = mlflow.MlflowClient(f"sqlite:///{db}")
    for e in c.search_experiments():
        for r in c.search_runs([e.experiment_id]):
            h = {k: [(m.step, round(m.value, 4)) for m in c.get_metric_history(r.info.run_id, k)]
                 for k in ("eval/avg@4", "eval/greedy_accuracy", "train/reward", "time/rollout_s", "time/update_s", "train/response_len")}
            label = "grpo lr=" + db.split("/tr")[-1].split("/")[0]
            rows[label] = h
            print(label, json.dumps({k: (v if k.startswith("eval") else v[::5]) for k, v in h.items()}))
json.dump(rows, open(f"{out}/calibration.json", "w"), indent=1)
PY

#!/bin/bash
# Calibration for the SmolLM2 comparison on reasoning-gym's gsm_symbolic (issue 30), one lent GPU, one call:
#   1. the pretrained SmolLM2-135M-Instruct, no fine-tuning: held-out greedy / sampled / privileged accuracy;
#   2. warm starts (SFT on the worked solutions), one process each, side by side on the card: "STEPS:LR ..." ;
#   3. GRPO runs side by side, each "WS_STEPS:WS_LR@LR x PROMPTS" (RL="100:2e-4@1e-5x64 ..."); without RL, one run
#      per learning rate in LRS from the warm start whose sampled accuracy is nearest 30%, PROMPTS prompts each.
# Run the same command again in a later call on the same warm machine and it resumes: finished warm starts are
# kept, each RL run continues from its last checkpoint (raise ITERS to extend it).
# Needs, installed earlier in the same warm machine: .whl (wheels.sh whl), .rgw (wheels.sh rg + install-rg), and
# SmolLM2 (smollm2_bring.sh). Results under $OUT: ws_*.json, train_*.log, calibration.json.
#   WS="400:2e-4" LRS="1e-5 3e-5 1e-4" ITERS=30 PROMPTS=32 bash experiments/gpu/smollm2_rg_calibrate.sh
#   WS="100:2e-4 200:2e-4" RL="100:2e-4@1e-5x64 200:2e-4@5e-6x64" ITERS=80 bash experiments/gpu/smollm2_rg_calibrate.sh
# (MICRO: sequences per forward/backward, 16 by default: at 64 each run peaked at ~36 GiB, too many for 4 runs side by side)
# (WS_MIN=M caps each warm start at M minutes; WS_EVAL=N evaluates it on N problems; PRE=0 skips the pretrained
# model's evaluation.)
set -uo pipefail
python -c "import gearlab.assigners" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
WS=${WS:-"400:2e-4"}; LRS=${LRS:-"1e-5 3e-5 1e-4"}; ITERS=${ITERS:-30}; WS_MIN=${WS_MIN:-}; PRE=${PRE:-1}
PROMPTS=${PROMPTS:-32}  # prompts per RL iteration (8 samples each)
# the RL runs stop cleanly (checkpoint, metrics kept) at this time, so that the summary below is written within
# BUDGET_S seconds of the start: keep BUDGET_S under the device call's limit
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-540} - 40 ))
W=${W:-/tmp/cal}; mkdir -p "$W"
COMMON=(model=smollm2_135m task=rg task.options.dataset=gsm_symbolic rollout.max_new_tokens=256
        warmstart.device=cuda warmstart.bf16=true warmstart.batch_size=64 warmstart.n_eval=${WS_EVAL:-200})
summary() { python -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[2], {k:d.get(k) for k in ('steps','lr','train_seconds','eval_seconds','loss_last','acc_plain_greedy','acc_plain_sampled','acc_privileged_greedy')})" "$@"; }

SECONDS=0
[ "$PRE" = 1 ] && ( gearlab warmstart "${COMMON[@]}" warmstart.steps=0 trainer.output_dir=$W/pre > "$OUT/ws_pretrained.log" 2>&1
  cp $W/pre/warmstart/smollm2-135m-rg/warmstart.json "$OUT/ws_pretrained.json" ) &
for v in $WS; do
  s=${v%%:*}; lr=${v##*:}
  [ -f "$W/ws_${s}_$lr/warmstart/smollm2-135m-rg/warmstart.json" ] && continue  # a resumed call
  ( gearlab warmstart "${COMMON[@]}" warmstart.steps=$s warmstart.lr=$lr ${WS_MIN:+warmstart.max_minutes=$WS_MIN} \
      trainer.output_dir=$W/ws_${s}_$lr > "$OUT/ws_${s}_$lr.log" 2>&1
    cp $W/ws_${s}_$lr/warmstart/smollm2-135m-rg/warmstart.json "$OUT/ws_${s}_$lr.json" ) &
done
wait
echo "warm starts done after ${SECONDS}s"
for f in "$OUT"/ws_*.json; do summary "$f" "$(basename "$f" .json)"; done
if [ -z "${RL:-}" ]; then
  best=$(python - "$OUT" <<'PY'
import glob, json, sys
c = [(abs(json.load(open(f))["acc_plain_sampled"] - 0.3), f) for f in glob.glob(f"{sys.argv[1]}/ws_*_*.json")]
print(min(c)[1].rsplit("/", 1)[1][3:-5] if c else "")
PY
)
  [ -n "$best" ] || exit 1
  RL=$(for lr in $LRS; do printf '%s@%sx%s ' "${best/_/:}" "$lr" "$PROMPTS"; done)
fi
echo "RL runs: $RL"
for e in $RL; do
  ws=${e%@*}; rest=${e#*@}; lr=${rest%x*}; p=${rest#*x}; wdir=$W/ws_${ws/:/_}
  [ -d "$wdir/warmstart/smollm2-135m-rg" ] || { echo "no warm start $ws for $e"; continue; }
  ( gearlab train "${COMMON[@]}" model.name_or_path=$wdir/warmstart/smollm2-135m-rg assigner=grpo optim.lr=$lr \
      rollout.prompts_per_step=$p rollout.group_size=8 rollout.batch_size=$((p * 8)) algorithm.micro_batch_size=${MICRO:-16} \
      trainer.precision=bf16-mixed trainer.max_steps=$ITERS trainer.eval_every=10 eval.num_problems=200 eval.k=4 \
      eval.seed=0 trainer.progress_bar=false trainer.output_dir=$W/rl_${ws/:/_}_${lr}x$p trainer.deadline=$DEADLINE \
      >> "$OUT/train_${ws/:/_}_${lr}x$p.log" 2>&1
    echo "train $e rc=$? after ${SECONDS}s" ) &
done
wait
python experiments/gpu/rl_histories.py "$OUT/calibration.json" /rl_ "$W/rl_*/mlflow.db" eval/avg_at_4 \
  eval/greedy_accuracy train/reward time/rollout_s time/update_s train/response_len train/frac_zero_std \
  update/grad_norm update/engine_lp_diff_abs update/engine_kl_k3
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
echo "total ${SECONDS}s"

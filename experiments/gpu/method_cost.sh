#!/bin/bash
# What one child of a comparison costs on this card, per method, before a session spends its budget on children that
# cannot finish in it (a child unfinished when the machine goes back starts again from 0). On this card: the preset's
# warm start re-made, then COST_STEPS iterations (default 4) of each method of COST_METHODS (default "grpo oar_g"),
# each alone in its own process with no evaluation, seed COST_SEED (default 0). Prints, and writes to
# $OUT/cost_<card>.json, per method the median seconds of rollout, signals + credit and update over the iterations
# after the first (the first warms the caches), their sum, and the ratio of that sum to the first method's.
#   bash experiments/gpu/method_cost.sh EXPERIMENT    # after compare_in_calls.sh's installs (SmolLM2, reasoning-gym)
# COST_ARGS: more overrides for the warm start and every run (a CPU dry run: experiment arith3_cpu, warmstart.steps=5);
# COST_ARGS_<method>: more for that method's run only (COST_ARGS_vineppo="assigner.options.k=2").
# Another kind of card than the comparison's makes another warm start: its times stand for that card's, and the
# ratios between methods carry over better than the seconds.
set -uo pipefail
EXP=$1; STEPS=${COST_STEPS:-4}; SEED=${COST_SEED:-0}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
mkdir -p "$OUT" runs && OUT=$(realpath "$OUT")
. "$(dirname "$0")/warm_start.sh"
card=$(card_name)
ws=$(warm_start "$OUT/cost_warmstart.log" experiment="$EXP" ${COST_ARGS:-} trainer.output_dir=runs/cost) || exit 1
methods=(${COST_METHODS:-grpo oar_g})
for a in "${methods[@]}"; do
  rm -rf "runs/cost_$a"
  SECONDS=0
  own="COST_ARGS_$a"
  timeout "${COST_TIMEOUT:-240}" gearlab train experiment="$EXP" ${COST_ARGS:-} assigner="$a" ${!own:-} \
    trainer.seed="$SEED" model.name_or_path="$ws" trainer.max_steps="$STEPS" eval.num_problems=0 \
    credit_eval.after_training=false trainer.progress_bar=false trainer.output_dir="runs/cost_$a" \
    > "$OUT/cost_$a.log" 2>&1
  echo "$a rc=$? ${SECONDS}s: $(grep -v '^\s*$' "$OUT/cost_$a.log" | tail -1 | cut -c1-200)"
done
python3 - "$OUT/cost_${card:-gpu}.json" "${methods[@]}" <<'P'
import json, statistics, sys
from pathlib import Path

sys.path.insert(0, "experiments/gpu")
from mlflow_runs import newest_run

KEYS = ("time/rollout_s", "time/signals_credit_s", "time/update_s")
out, base = {}, None
for a in sys.argv[2:]:
    try:
        client, run = newest_run(Path(f"runs/cost_{a}"))
    except (Exception, SystemExit) as e:  # a method that did not run: say so, keep the others
        out[a] = {"error": str(e)[:200]}
        continue

    def hist(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    h = {k: hist(k)[1:] for k in KEYS}  # the first iteration compiles and warms caches: not timed
    row = {k.split("/")[1]: round(statistics.median(v), 3) for k, v in h.items() if v}
    for k in ("mc/continuations", "mc/tokens"):  # a Monte-Carlo method's work per iteration (VinePPO), all of them
        if v := hist(k):
            row[k.replace("/", "_")] = statistics.median(v)
    row["iterations_timed"] = len(h["time/rollout_s"])
    row["sum_s"] = round(sum(row.get(k.split("/")[1], 0.0) for k in KEYS), 3)
    base = base or row["sum_s"]
    row["ratio_to_first"] = round(row["sum_s"] / base, 3)
    out[a] = row
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
P

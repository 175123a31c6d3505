#!/bin/bash
# Can another kind of card carry on a comparison made on one kind? On this card: re-make the preset's warm start
# (its sha256 against the one the comparison started from, the parent run's start_sha256 tag), then run the first
# PROBE_STEPS iterations of a finished child (PROBE_CHILD, default rlsd-s0) twice, each its own process, and compare
# every iteration's rollout crc, data crc, reward, credit and update with the child's stored ones
# (experiments/gpu/card_probe.py -> $OUT/card_probe_<card>.json). Equal bits: the card can run the comparison's
# remaining children, paired exactly.
#   bash experiments/gpu/card_probe.sh EXPERIMENT        # after compare_in_calls.sh's installs (SmolLM2, reasoning-gym)
# The store comes from .gpu_state/<EXPERIMENT>-store.tgz (or /tmp/gpu_state/), as for compare_in_calls.sh.
set -uo pipefail
EXP=$1; CHILD=${PROBE_CHILD:-rlsd-s0}; STEPS=${PROBE_STEPS:-3}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
mkdir -p "$OUT" runs && OUT=$(realpath "$OUT")
. "$(dirname "$0")/warm_start.sh"
card=$(card_name)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
STATE=.gpu_state/$EXP-store.tgz; [[ -f $STATE ]] || STATE=/tmp/gpu_state/$EXP-store.tgz
[[ -f runs/mlflow.db ]] || tar xzf "$STATE" -C runs
ws=$(warm_start "$OUT/warmstart.log" experiment="$EXP" trainer.output_dir=runs) || exit 1
python - runs/mlflow.db "$EXP" "$ws" <<'PY'
import json, sys
from pathlib import Path
import mlflow
c = mlflow.MlflowClient(f"sqlite:///{Path(sys.argv[1]).resolve()}")
parent = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id]) if r.info.run_name == sys.argv[2]]
want = parent[0].data.tags.get("start_sha256") if parent else None
got = json.loads((Path(sys.argv[3]) / "warmstart.json").read_text())["weights_sha256"]
print(f"warm start sha256 {got[:12]} here, {str(want)[:12]} in the store: {'EQUAL' if got == want else 'DIFFERENT'}")
PY
seed=${CHILD##*-s}; assigner=${CHILD%-s*}
for x in a b; do
  timeout ${PROBE_TIMEOUT:-240} gearlab train experiment="$EXP" assigner="$assigner" trainer.seed="$seed" \
    model.name_or_path="$ws" trainer.max_steps="$STEPS" trainer.threads=4 trainer.output_dir="probe_$x" \
    credit_eval.after_training=false > "$OUT/probe_$x.log" 2>&1
  echo "probe $x rc=$? $(grep -o 'done: .*' "$OUT/probe_$x.log" | tail -1)"
done
(cd experiments/gpu && python card_probe.py ../../runs "$CHILD" ../../probe_a ../../probe_b \
  --out "$OUT/card_probe_${card:-gpu}.json") | tail -8
echo "card_probe rc=${PIPESTATUS[0]}"

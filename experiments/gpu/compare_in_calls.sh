#!/bin/bash
# One comparison spread over several device calls of at most 10 minutes (issue 17). Every call runs the same
# command; each ends itself before the call's limit and can be followed by the next:
#   bash experiments/gpu/compare_in_calls.sh EXPERIMENT [overrides...]
# - Children stop cleanly at an iteration boundary at trainer.deadline (now + BUDGET_S - TAIL_S), with a checkpoint;
#   queued ones are left for the next call. On a machine still warm from the last call, runs/ (checkpoints, the warm
#   start, the MLflow store) is still there and everything resumes exactly.
# - On a fresh machine the MLflow store of the last call is restored from .gpu_state/<EXPERIMENT>-store.tgz (carry
#   .gpu_state; put the last call's $OUT/<EXPERIMENT>-store.tgz there), the warm start is re-made (deterministic;
#   `gearlab compare` checks its sha256 against the comparison's), finished children are kept, and a child whose
#   checkpoint stayed on the old machine starts again from iteration 0.
# - carry .whl too: wheels the device image lacks (omegaconf, mlflow and its dependencies), for its Python.
# Give every call of one comparison the same kind of card: the warm start's bits are the card's.
set -uo pipefail
BUDGET_S=${BUDGET_S:-575}  # this script's whole run; keep it under the call's timeout_s
TAIL_S=${TAIL_S:-100}      # after the deadline: the last iteration, a child's final evaluation and credit-eval, packing
python -c "import mlflow, omegaconf" 2>/dev/null || python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
python -c "import gearlab.assigners" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
EXP=$1; shift
R=${RUNS:-runs}; STATE=.gpu_state/$EXP-store.tgz
mkdir -p "$R" "$OUT"
if [[ -f $R/mlflow.db ]]; then echo "warm machine: $R/ kept from the last call"
elif [[ -f $STATE ]]; then tar xzf "$STATE" -C "$R" && echo "fresh machine: store restored from $STATE"
else echo "fresh machine, new comparison"; fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
  && { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 20 >> "$OUT/gpu_use.csv" & }
DEADLINE=$(( $(date +%s) + BUDGET_S - SECONDS - TAIL_S ))
echo "children stop at $(date -d @"$DEADLINE" +%T) (now $(date +%T))"
timeout -s INT $(( BUDGET_S - SECONDS - 15 )) gearlab compare experiment="$EXP" trainer.output_dir="$R" \
  trainer.deadline="$DEADLINE" "$@" >> "$OUT/compare.log" 2>&1
echo "compare rc=$? after ${SECONDS}s"
grep -E '^\[compare\]|^\||^learning|^power|^signals|rror' "$OUT/compare.log" | tail -60
tar czf "$OUT/$EXP-store.tgz" -C "$R" mlflow.db mlartifacts && ls -la "$OUT/$EXP-store.tgz"
mkdir -p "$OUT/logs" && for f in "$R/$EXP"/*/train.log; do  # every child's log (its timings, its error) comes back
  [[ -f $f ]] && tail -c 300000 "$f" > "$OUT/logs/$(basename "$(dirname "$f")").log"; done
[[ -d $R/$EXP/report ]] && cp "$R/$EXP/report/report.md" "$R/$EXP/report/curves.png" "$OUT/" 2>/dev/null
kill %1 2>/dev/null; true

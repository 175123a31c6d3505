#!/bin/bash
# A comparison split over several ≤ 10-minute device calls (issue 17). Each call restores the MLflow store of the
# previous one, runs the comparison for the seeds given (children finished earlier are skipped; the shared start is
# re-made by the deterministic warm start and checked against the comparison's start_sha256), and packs the store
# (mlflow.db, mlartifacts/: metrics, tags, credit-eval files, report; no weights) into $OUT for the next call.
#   bash experiments/gpu/compare_by_seed.sh EXPERIMENT "0 1" [overrides...]
# carry: .whl (wheels the image lacks) and .gpu_state (put the previous call's $OUT/<EXPERIMENT>-store.tgz there).
# Give every call of one comparison the same kind of card: the warm start's bits are the card's.
set -uo pipefail
python -c "import mlflow, omegaconf" 2>/dev/null || python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
python -c "import gearlab.assigners" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-gpu_out}
EXP=$1; SEEDS=$2; shift 2
R=${RUNS:-runs}; STATE=.gpu_state/$EXP-store.tgz
mkdir -p "$R" "$OUT"
if [[ -f $STATE && ! -f $R/mlflow.db ]]; then tar xzf "$STATE" -C "$R" && echo "restored $STATE"; fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader
gearlab compare experiment="$EXP" compare.seeds="[${SEEDS// /,}]" trainer.output_dir="$R" "$@" > "$OUT/compare.log" 2>&1
echo "compare rc=$?"
grep -E '^\[compare\]|^\||^learning|^power|error' "$OUT/compare.log" | tail -40
tar czf "$OUT/$EXP-store.tgz" -C "$R" mlflow.db mlartifacts && ls -la "$OUT/$EXP-store.tgz"

#!/bin/bash
# One comparison spread over several device calls of at most 10 minutes. Every call runs the same command:
#   bash experiments/gpu/compare_in_calls.sh EXPERIMENT [overrides...]
# - The first call on a machine starts `gearlab compare` in a process session of its own (setsid): the device tool
#   ends what a call leaves running except such a session, so the comparison goes on between calls, with no stop and
#   restart of its children. Every call then watches it for BUDGET_S seconds (or until it ends) and sends back the
#   progress, each child's log and a consistent copy of the MLflow store ($OUT/<EXPERIMENT>-store.tgz).
# - Calls must follow each other within the machine's idle window (30 s): a machine that goes back takes the
#   children's checkpoints with it.
# - On a fresh machine the store of the last call is restored from .gpu_state/<EXPERIMENT>-store.tgz (carry
#   .gpu_state; put the last call's $OUT/<EXPERIMENT>-store.tgz there), the warm start is re-made (deterministic;
#   `gearlab compare` checks its sha256 against the comparison's), finished children are kept, and a child whose
#   checkpoint stayed on the old machine starts again from iteration 0.
# - carry .whl too: wheels the device image lacks (omegaconf, mlflow and its dependencies), for its Python.
# Give every call of one comparison the same kind of card: the warm start's bits are the card's.
set -uo pipefail
BUDGET_S=${BUDGET_S:-570}  # this call's whole run; keep it under the call's timeout_s
python -c "import mlflow, omegaconf" 2>/dev/null || python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
python -c "import gearlab.assigners" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
EXP=$1; shift
R=${RUNS:-runs}; STATE=.gpu_state/$EXP-store.tgz; LOG=$R/$EXP-compare.log; PIDF=$R/$EXP-compare.pid
mkdir -p "$R" "$OUT"
if [[ -f $PIDF ]] && kill -0 "$(cat "$PIDF")" 2>/dev/null; then echo "warm machine: the comparison is running"
else
  if [[ -f $R/mlflow.db ]]; then echo "warm machine: $R/ kept, the comparison starts again (resumes)"
  elif [[ -f $STATE ]]; then tar xzf "$STATE" -C "$R" && echo "fresh machine: store restored from $STATE"
  else echo "fresh machine, new comparison"; fi
  # on a host of several cards: WORKERS_PER_GPU children on each (compare.gpus spreads the workers round-robin);
  # compare.* settings are not part of a child's configuration, so one and two cards can share a comparison
  NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  (( NG > 1 )) && set -- "compare.workers=$(( ${WORKERS_PER_GPU:-3} * NG ))" "$@"
  # MPS=1: the children's kernels run side by side through CUDA's Multi-Process Service instead of time-sliced
  # (the same bits: experiments/gpu/mps_probe.sh checks it on the card first); the daemon lives until the machine goes
  if [[ ${MPS:-0} == 1 ]]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || setsid nvidia-cuda-mps-control -d
    echo "MPS: control daemon in $CUDA_MPS_PIPE_DIRECTORY"
  fi
  setsid gearlab compare experiment="$EXP" trainer.output_dir="$R" "$@" >> "$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDF"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
  && { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 20 >> "$OUT/gpu_use.csv" &
        SMI=$!; }
while kill -0 "$(cat "$PIDF")" 2>/dev/null && (( SECONDS < BUDGET_S - 25 )); do sleep 5; done
kill -0 "$(cat "$PIDF")" 2>/dev/null && echo "still running after ${SECONDS}s" || echo "the comparison ended after ${SECONDS}s"
grep -E '^\[compare\]|^\||^learning|^power|^signals|rror' "$LOG" | tail -60
# the store while the comparison writes to it: SQLite's online backup is a consistent copy
mkdir -p /tmp/store_copy && python - "$R/mlflow.db" /tmp/store_copy/mlflow.db <<'EOF'
import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
src.backup(dst)
dst.close()
EOF
rm -rf /tmp/store_copy/mlartifacts && cp -r "$R/mlartifacts" /tmp/store_copy/ 2>/dev/null
tar czf "$OUT/$EXP-store.tgz" -C /tmp/store_copy . && ls -la "$OUT/$EXP-store.tgz"
# the logs as one file: a call sends back at most 8 files, and four children's logs, the store, the report and its
# plot would be more
L=$(mktemp -d) && cp "$LOG" "$L/" && for f in "$R/$EXP"/*/train.log; do
  [[ -f $f ]] && tail -c 300000 "$f" > "$L/$(basename "$(dirname "$f")").log"; done  # each child's timings, errors
tar czf "$OUT/logs.tgz" -C "$L" . && echo "logs: $(ls "$L" | wc -l) files in $OUT/logs.tgz"
[[ -d $R/$EXP/report ]] && cp "$R/$EXP/report/report.md" "$R/$EXP/report/curves.png" "$OUT/" 2>/dev/null
[[ -n ${SMI:-} ]] && kill "$SMI" 2>/dev/null; true

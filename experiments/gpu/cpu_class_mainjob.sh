#!/usr/bin/env bash
# The main job on another CPU class: the host CPU of a lent GPU machine (Intel Xeon), CUDA hidden. Device `run`
# with carry [".whl"] (experiments/gpu/wheels.sh whl):  bash experiments/gpu/cpu_class_mainjob.sh
# Runs `gearlab compare experiment=embedded` with 10 worker processes (each child is single-threaded, so the worker
# count changes no digit, only the wall time) and, beside it, the op trace of gear-s0's first 12 iterations
# (experiments/cpu_op_trace.py). Writes under $OUT: compare.txt (the printout), children.txt (each run's final
# weights digest, avg@4 and greedy accuracy), gear_iterations.txt and gear_ops.txt.gz.
. experiments/gpu/site.sh
export CUDA_VISIBLE_DEVICES=
lscpu | grep "Model name"
(timeout 500 python3 experiments/cpu_op_trace.py /tmp/trG assigner=gear trainer.max_steps=12 > $OUT/trG.log 2>&1; cp /tmp/trG/iterations.txt $OUT/gear_iterations.txt; cp /tmp/trG/ops.txt.gz $OUT/gear_ops.txt.gz) &
timeout 540 gearlab compare experiment=embedded compare.workers=10 > $OUT/compare.txt 2>&1
python3 - <<'P' > $OUT/children.txt
import json, glob, os
from gearlab.models.checkpoints import weights_digest
for d in sorted(glob.glob('runs/embedded/*-s*/')):
    s = json.load(open(d + 'summary.json'))['metrics'] if os.path.exists(d + 'summary.json') else {}
    print(os.path.basename(d.rstrip('/')), (weights_digest(d + 'final') or '')[:16], s.get('eval/avg_at_4'), s.get('eval/greedy_accuracy'))
P
wait
cat $OUT/children.txt; tail -30 $OUT/compare.txt

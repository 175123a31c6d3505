#!/usr/bin/env bash
# Is gearlab's oneDNN route for nn.Linear (gearlab.cpu_kernels.route_linear) vendor-independent, and how long does the
# main job take on 2 cores of an Intel Xeon? On the host CPU of a lent GPU machine, CUDA hidden. Device `run` with
# carry [".whl"] (experiments/gpu/wheels.sh whl):  bash experiments/gpu/cpu_linear_check.sh
# On cores 0-1 alone: the README's main job (`gearlab compare experiment=embedded`, 2 workers of 1 thread), timed.
# Beside it on cores 2-5: the op probe, `gearlab warmstart` (600 SFT steps on 2 threads) and the 2 GEAR iterations
# of tests/models/test_warmstart.py. Run the same here with the same torch and compare the digests. Writes $OUT/*.
# ALONE=1: only the timed comparison (nothing beside it).
. experiments/gpu/site.sh
export CUDA_VISIBLE_DEVICES=
lscpu | grep "Model name" | tee $OUT/cpu.txt
python3 -c "import torch; print(torch.__version__)" >> $OUT/cpu.txt
grep -q Intel $OUT/cpu.txt || { echo "not an Intel host: nothing to compare"; [ -n "$ANY_CPU" ] || exit 3; }
now() { python3 -c "import time; print(f'{time.time():.1f}')"; }
[ -n "$ALONE" ] || ( taskset -c 2,3 python3 experiments/cpu_op_probe.py > $OUT/ops.json 2> $OUT/ops.err
  taskset -c 2,3 timeout 400 gearlab train trainer.output_dir=/tmp/rl assigner=gear trainer.max_steps=2 \
    trainer.threads=1 trainer.accelerator=cpu rollout.prompts_per_step=8 rollout.group_size=4 eval.num_problems=16 \
    trainer.progress_bar=false trainer.run_name=pinned logging.tracking_uri=sqlite:////tmp/rl/mlflow.db > $OUT/rl.log 2>&1
  python3 -c "from gearlab.models.checkpoints import weights_digest as w; print('rl2', w('/tmp/rl/pinned/final'))" >> $OUT/digests.txt ) &
[ -n "$ALONE" ] || ( s=$(now); taskset -c 4,5 timeout 500 gearlab warmstart trainer.output_dir=/tmp/ws > $OUT/warmstart.log 2>&1
  echo "warmstart rc=$? seconds=$(python3 -c "print(round($(now)-$s,1))")" >> $OUT/digests.txt
  cp /tmp/ws/embedded/tiny-arith/warmstart.json $OUT/warmstart.json ) &
s=$(now)
taskset -c 0,1 timeout 560 gearlab compare experiment=embedded > $OUT/compare.txt 2>&1
echo "compare rc=$? seconds=$(python3 -c "print(round($(now)-$s,1))")" >> $OUT/digests.txt
python3 - <<'P' > $OUT/children.txt
import json, glob, os
from gearlab.models.checkpoints import weights_digest
for d in sorted(glob.glob('runs/embedded/*-s*/')):
    s = json.load(open(d + 'summary.json'))['metrics'] if os.path.exists(d + 'summary.json') else {}
    print(os.path.basename(d.rstrip('/')), (weights_digest(d + 'final') or '')[:16], s.get('eval/avg_at_4'), s.get('eval/greedy_accuracy'))
P
wait
cat $OUT/digests.txt $OUT/children.txt; tail -32 $OUT/compare.txt

#!/usr/bin/env bash
# Is a faster MKL branch than COMPATIBLE also vendor-independent? On the Intel host of a lent GPU machine (CUDA
# hidden), for each MKL_CBWR value: the op hashes (experiments/cpu_op_probe.py), MKL's vector maths
# (experiments/cpu_vml_probe.py --cbwr), a traced main-job child of 3 GRPO iterations (experiments/cpu_op_trace.py)
# and the time of the tiny model's matrix products; and, on 2 cores of their own (taskset), one grpo and one gear
# child of the main job with the default pin, timed (the child's wall time against this machine's, see
# experiments/results/cpu_classes/). Run the same here (torch 2.11, the device image's) and compare.
# Device `run` with carry [".whl"]:  bash experiments/gpu/cpu_branch_probe.sh   (writes $OUT/branches.tgz)
. experiments/gpu/site.sh
export CUDA_VISIBLE_DEVICES=
D=${OUT:-/tmp/out}/branches; mkdir -p $D; lscpu | grep "Model name" > $D/cpu.txt
now() { python3 -c "import time; print(f'{time.time():.2f}')"; }
(for a in grpo gear; do s=$(now); taskset -c 0,1 timeout 300 gearlab train experiment=embedded assigner=$a trainer.seed=0 \
   trainer.output_dir=/tmp/ct trainer.run_name=ct-$a logging.tracking_uri=sqlite:////tmp/ct/mlflow.db > $D/child_$a.log 2>&1
   echo "$a rc=$? start=$s end=$(now)" >> $D/child_time.txt; done) &
for V in COMPATIBLE SSE4_2 AVX AVX2,STRICT; do
  n=${V//,/_}
  (MKL_CBWR=$V timeout 400 taskset -c 2-15 python3 experiments/cpu_op_trace.py /tmp/tr_$n trainer.max_steps=3 > $D/trace_$n.log 2>&1
   cp /tmp/tr_$n/iterations.txt $D/iterations_$n.txt; cp /tmp/tr_$n/ops.txt.gz $D/ops_trace_$n.txt.gz) &
  MKL_CBWR=$V taskset -c 2-15 python3 experiments/cpu_op_probe.py > $D/ops_$n.json 2>$D/ops_$n.err &
  MKL_CBWR=$V taskset -c 2-15 python3 experiments/cpu_mm_speed.py > $D/speed_$n.txt 2>&1 &
done
taskset -c 2-15 python3 experiments/cpu_vml_probe.py --cbwr SSE4_2 --cbwr AVX --cbwr AVX2,STRICT > $D/vml.json 2>$D/vml.err
wait
tar czf ${OUT:-/tmp/out}/branches.tgz -C ${OUT:-/tmp/out} branches && rm -rf $D

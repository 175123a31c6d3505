#!/usr/bin/env bash
# 1 GPU vs 2 GPUs (FSDP2, NCCL) give the same run: `gearlab train` from the shipped warm start, 2 iterations, in
# two settings of tests/parallel/test_world_size.py, on a 2-GPU kind (device `run`, carry [".whl"]):
#   [ENGINE=hf] bash experiments/gpu/world_size_gpu.sh      (default ENGINE=auto)
# C = A with rollout.batch_size=16: each generate call then holds the same 16 rows on 1 GPU (two calls) as on each of
# 2 GPUs (one call), so batch-shape-dependent GPU kernels see the same shapes.
# DTYPE=float32 trains float32 parameters; the default, model.dtype=auto, trains bfloat16 ones on a GPU under
# trainer.precision=32-true (the 2026-11-28 measurements). experiments/gpu/world_size_trace.sh shows where runs part.
# Prints, per setting, ||w(2) - w(1)|| / ||w(1) - w(start)|| and the max-element ratio; writes $OUT/world_size.json.
. experiments/gpu/site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
common="trainer.accelerator=gpu trainer.precision=32-true rollout.prompts_per_step=8 rollout.group_size=4 trainer.max_steps=2 eval.num_problems=0 trainer.progress_bar=false optim.lr=1e-3 trainer.run_name=ws rollout.engine=${ENGINE:-auto} model.dtype=${DTYPE:-auto}"
rm -rf /tmp/A-1 /tmp/A-2 /tmp/B-1 /tmp/B-2 /tmp/C-1 /tmp/C-2
run() { out=$1; dev=$2; shift 2; timeout 200 gearlab train $common trainer.devices=$dev trainer.output_dir=$out "$@" > $out.log 2>&1 || tail -5 $out.log; }
for s in "A algorithm.agg=seq-mean-token-sum-norm algorithm.std_scope=batch algorithm.mini_batches=2" \
         "B algorithm.agg=token-mean algorithm.ppo_epochs=2 assigner=gear" \
         "C algorithm.agg=seq-mean-token-sum-norm algorithm.std_scope=batch algorithm.mini_batches=2 rollout.batch_size=16"; do
  set -- $s; name=$1; shift
  run /tmp/$name-1 1 "$@"; run /tmp/$name-2 2 "$@"
done
python3 - <<'P'
import json, os, torch
from safetensors.torch import load_file
res = {"gpu": os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().split("\n")[0]}
for n in ("A", "B", "C"):
    try:
        s = load_file(f"/tmp/{n}-1/embedded/tiny-arith/model.safetensors")
        a, b = load_file(f"/tmp/{n}-1/ws/final/model.safetensors"), load_file(f"/tmp/{n}-2/ws/final/model.safetensors")
    except Exception as e:
        res[n] = repr(e); continue
    up = torch.cat([(a[k] - s[k]).flatten() for k in a]); gap = torch.cat([(b[k] - a[k]).flatten() for k in a])
    res[n] = {"norm_ratio": float(gap.norm() / up.norm()), "max_ratio": float(gap.abs().max() / up.abs().max())}
print(json.dumps(res))
json.dump(res, open(os.environ["OUT"] + "/world_size.json", "w"))
P

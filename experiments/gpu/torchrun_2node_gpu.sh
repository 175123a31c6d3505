#!/usr/bin/env bash
# Issue 29 item 5 on a lent 2-GPU host: one real two-"node" GPU launch. Two torchrun agents on this host, each a
# "node" with one process and its own GPU (CUDA_VISIBLE_DEVICES), meet over a localhost c10d rendezvous; NCCL
# carries the collectives. They train `gearlab train` (the shipped warm start, FSDP2, rollout.engine=auto) for 3
# iterations with a sharded checkpoint and evaluation split over the two ranks. Needs the wheels installed
# (experiments/gpu/wheels.sh). Writes $OUT/torchrun_2node.json and both agents' logs.
#   bash experiments/gpu/torchrun_2node_gpu.sh
set -uo pipefail
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
R=/tmp/tr2; rm -rf "$R"; mkdir -p "$R"
args=(trainer.accelerator=gpu trainer.devices=1 trainer.num_nodes=2 trainer.strategy=fsdp2 trainer.max_steps=3
      trainer.checkpoint_every=2 rollout.prompts_per_step=8 rollout.group_size=4 eval.num_problems=8 eval.k=2
      trainer.progress_bar=false trainer.output_dir="$R" trainer.run_name=tr2)
t0=$(date +%s)
for n in 0 1; do
  CUDA_VISIBLE_DEVICES=$n timeout 240 python3 -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank $n \
    --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:29517 --rdzv_id gearlab2node \
    -m gearlab.cli train "${args[@]}" > "$OUT/torchrun_node$n.log" 2>&1 &
done
rc0=0; rc1=0; wait %1 || rc0=$?; wait %2 || rc1=$?
python3 - "$rc0" "$rc1" "$(( $(date +%s) - t0 ))" <<'P'
import glob, json, os, re, sys
out = os.environ.get("OUT", "gpu_out")
logs = [open(f"{out}/torchrun_node{n}.log", errors="replace").read() for n in (0, 1)]
gpus = os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().split("\n")
res = {"gpus": [g for g in gpus if g], "returncodes": [int(sys.argv[1]), int(sys.argv[2])], "wall_s": int(sys.argv[3]),
       "members": sorted(set(re.findall(r"MEMBER: \d/\d", "".join(logs)))),
       "backend": sorted(set(re.findall(r"distributed_backend=(\w+)", "".join(logs)))),
       "shards": sorted(os.path.basename(p) for p in glob.glob("/tmp/tr2/tr2/checkpoints/last.ckpt/*.distcp")),
       "final_weights": os.path.isfile("/tmp/tr2/tr2/final/model.safetensors"),
       "engine": re.findall(r"engine: (\w+)", open(glob.glob("/tmp/tr2/tr2/config.yaml")[0]).read())[:1]
       if glob.glob("/tmp/tr2/tr2/config.yaml") else None,
       "tail": [lg.strip().splitlines()[-1:] for lg in logs]}
print(json.dumps(res))
json.dump(res, open(f"{out}/torchrun_2node.json", "w"), indent=2)
P

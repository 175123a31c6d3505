#!/usr/bin/env bash
# Where 1 GPU and 2 GPUs part (issue 29), on a 2-GPU kind (device `run`, carry [".whl"]):
#   bash experiments/gpu/world_size_trace.sh          (ACCEL=cpu runs the same on two CPU processes)
# Setting A of world_size_gpu.sh (2 iterations, 2 mini-batches each), traced by experiments/gpu/world_size_trace.py
# (sampled tokens, weights, full gradients before every optimizer step), in pairs of 1 and 2 processes:
#   a  the defaults (twice on 1 process: the run-to-run floor)
#   c  algorithm.crop_padding=false (every micro-batch as wide as the batch)
#   d  deterministic kernels and SDPA's math backend (TRACE_DETERMINISTIC=1)
# or, with SET=dtype, by the parameters' dtype: f float32, m bf16-mixed over float32 (a = auto = bfloat16 on a
# GPU under trainer.precision=32-true); SET=mixed: bf16-mixed with 2 mini-batches and with 1; SET=one: one GPU, unsharded vs FSDP2 (bf16-mixed); SET=chunk: bf16-mixed with rollout.batch_size=16 (the same decode shapes)
# All runs share one output folder (one warm start) and differ by run name. Writes $OUT/world_size_trace.json.
. experiments/gpu/site.sh
OUT="${OUT:-/tmp/wst_out}"; T="${TRACE_ROOT:-/tmp/wst}"; rm -rf "$T"; mkdir -p "$OUT" "$T"
accel="${ACCEL:-gpu}"
common="trainer.accelerator=$accel trainer.precision=32-true rollout.prompts_per_step=8 rollout.group_size=4 trainer.max_steps=2 eval.num_problems=0 trainer.progress_bar=false optim.lr=1e-3 algorithm.agg=seq-mean-token-sum-norm algorithm.std_scope=batch algorithm.mini_batches=2 trainer.output_dir=$T/runs"
run() { name=$1; dev=$2; det=$3; shift 3
  TRACE_DIR=$T/$name TRACE_GRADS=1 TRACE_DETERMINISTIC=$det timeout 300 python experiments/gpu/world_size_trace.py \
    train $common trainer.devices=$dev trainer.run_name=$name "$@" > $T/$name.log 2>&1 || { echo "$name failed"; tail -5 $T/$name.log; }
}
if [[ "${SET:-kernels}" == kernels ]]; then
  run a1 1 0; run a1b 1 0; run a2 2 0
  run c1 1 0 algorithm.crop_padding=false; run c2 2 0 algorithm.crop_padding=false
  run d1 1 1; run d2 2 1
  pairs="a1:a1b a1:a2 c1:c2 d1:d2 a1:c1 a1:d1"
elif [[ "$SET" == mixed ]]; then
  # micro-batches of 8 × 2 mini-batches: tiles of 16 rows, one per rank (the same passes on 1 and 2 GPUs)
  run m1 1 0 trainer.precision=bf16-mixed algorithm.micro_batch_size=8; run m2 2 0 trainer.precision=bf16-mixed algorithm.micro_batch_size=8
  # one mini-batch: rank r's micro-batches then hold the rows of 1 GPU's micro-batches (micro_batch_size divides 16)
  run n1 1 0 trainer.precision=bf16-mixed algorithm.mini_batches=1; run n2 2 0 trainer.precision=bf16-mixed algorithm.mini_batches=1
  pairs="m1:m2 n1:n2"
elif [[ "$SET" == one ]]; then  # one GPU: unsharded vs FSDP2 over a mesh of 1, bf16-mixed, with and without
  # activation checkpointing (the same rows in every backward pass: the bits should agree)
  run m1 1 0 trainer.precision=bf16-mixed; run s1 1 0 trainer.precision=bf16-mixed trainer.strategy=fsdp2
  run m1k 1 0 trainer.precision=bf16-mixed trainer.activation_checkpointing=true
  run s1k 1 0 trainer.precision=bf16-mixed trainer.strategy=fsdp2 trainer.activation_checkpointing=true
  pairs="m1:s1 m1k:s1k"
elif [[ "$SET" == chunk ]]; then  # bf16-mixed, each generate call 16 rows on 1 GPU as on each of 2
  run m1c 1 0 trainer.precision=bf16-mixed rollout.batch_size=16; run m2c 2 0 trainer.precision=bf16-mixed rollout.batch_size=16
  pairs="m1c:m2c"
else  # SET=dtype: the parameters' dtype (model.dtype=auto is bfloat16 on a GPU under 32-true)
  run f1 1 0 model.dtype=float32; run f2 2 0 model.dtype=float32
  run m1 1 0 trainer.precision=bf16-mixed; run m2 2 0 trainer.precision=bf16-mixed
  pairs="f1:f2 m1:m2"
fi
{
  echo "{\"device\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)\","
  for p in $pairs; do set -- ${p/:/ }
    r=$(python experiments/gpu/world_size_trace.py compare $T/$1 $T/$2 2>&1 | tail -1); [[ $r == {* ]] || r="\"${r//\"/}\""; echo "\"$1 vs $2\": $r,"; done
  echo "\"end\": null}"
} > "$OUT/world_size_trace.json"
python -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, json.dumps(v)[:1500]) for k,v in d.items()]" "$OUT/world_size_trace.json"

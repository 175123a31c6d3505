#!/bin/bash
# The fast decode path (rollout.engine=fast, issue 19) and gearlab's vLLM engine (issue 18) on a lent GPU, in calls of
# at most 10 minutes. Parts run in the order given:
#   check    ~4 min: experiments/gpu/fast_decode_check.py (correctness on the GPU, decode ms/step of HF static+compiled
#            vs fast eager/graphs); needs no wheels; CHECK_ONLY=check_split,check_flex_long runs those checks only
#   attn     ~1 min: experiments/bench/decode_attention.py (decode attention kernels alone, at the benchmark's shape;
#            ATTN_BATCHES="128 16" and ATTN_LENGTHS=256,1024,2048 for reasoning lengths)
#   credit   ~2 min: experiments/bench/credit_cost.py on the Qwen3-0.6B preset for the entropy methods, with the entropy
#            computed in the update's forward (needs omegaconf)
#   bench    ~6 min: the TRL-vs-gearlab table, each variant in its own process; BENCH_VARIANTS (default
#            trl_default,trl_tuned,gearlab_tuned,gearlab_fast) and BENCH_NAME (default trl_vs_gearlab_tuned; _h200 or _h100 is appended);
#            BENCH_NEW (new tokens per completion, forced to full length; 0 = the workload's 256), BENCH_ITERS (4) and
#            BENCH_VARIANT_TIMEOUT (seconds per variant, 0 = none: one over it is recorded as an error, the rest run;
#            every finished variant is in the JSON and each iteration's times are in the log as they happen) and
#            BENCH_VLLM_MEM (the vLLM variants' gpu_memory_utilization, 0.3; 0.55 holds the KV cache at 2,048 tokens)
#   vllm     ~4 min: experiments/gpu/vllm_check.py (needs vLLM from experiments/gpu/vllm_bring.sh)
#   auto     ~2 min: 3 iterations of arith_long_gpu with rollout.engine=auto: the run's config.yaml must record
#            engine: fast (the default on one CUDA device) and attention: split (rollout.fast.attention=auto with
#            Triton), with its decode metrics
#   rerun    ~4 min: the same short GEAR run twice (arith_long_gpu, 50-step warm start, RERUN_STEPS=4 iterations, the
#            defaults: engine auto, attention auto), each its own process; experiments/gpu/rerun_check.py must find
#            every iteration's rollout crc, rewards, credit and update equal (RERUN_ASSIGNER, default gear).
#            RERUN_EXP and RERUN_ARGS (default warmstart.steps=50) run another preset: a SmolLM2 child of the
#            comparison from its warm start, beside compare_in_calls.sh on the same machine, is
#            RERUN_EXP=smollm2_gsm_gpu RERUN_ARGS="model.name_or_path=$PWD/runs/warmstart/smollm2-135m-rg"
#   varlen   ~8 min: 50 iterations of a real run whose responses vary in length (experiment=arith_long_gpu with a
#            200-step warm start, engine=fast, trainer.compile)
# Wheels: every carried folder of them among .wo .wa .wb .whl .trlw is installed once per machine
# (experiments/gpu/wheels.sh makes .whl and .trlw; the calls of issue 18 split them to fit beside the vLLM pieces).
# If $VLLM_SITE/env.sh exists (vLLM installed by vllm_bring.sh, same variable and default), the vllm part and the
# gearlab_vllm / trl_vllm bench variants use it.
# Results land in $OUT; name the card (nvidia-smi's line is printed first) next to every number you copy.
set -uo pipefail
. experiments/gpu/rerun_pair.sh
VSITE=${VLLM_SITE:-/tmp/vsite}  # (vllm_bring.sh's default: /tmp is what survives between warm calls)
MARK=${TMPDIR:-/tmp}/.gearlab_installed
for d in .wo .wa .wb .whl .trlw; do
  [ -d $d ] && [ ! -f $MARK$d ] && python -m pip install -q --no-deps $d/*.whl 2>&1 | grep -v WARNING | tail -1 && touch $MARK$d
done
python -c "import gearlab.assigners" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
. "$(dirname "$0")/warm_start.sh"
card=$(card_name)  # h200 | h100 (file names)
for part in "$@"; do
  case $part in
  check)
    timeout ${CHECK_TIMEOUT:-300} python experiments/gpu/fast_decode_check.py --out "$OUT/fast_decode_check.json" \
      ${CHECK_ONLY:+--only "$CHECK_ONLY"} > "$OUT/check.log" 2>&1
    echo "check rc=$?"; tail -c 2500 "$OUT/check.log" ;;
  attn)
    for b in ${ATTN_BATCHES:-128}; do  # ATTN_LENGTHS (default 128,192,256,320), e.g. 256,1024,2048
      timeout ${ATTN_TIMEOUT:-150} python experiments/bench/decode_attention.py --batch "$b" \
        --lengths "${ATTN_LENGTHS:-128,192,256,320}" --out "$OUT/decode_attention_${card:-gpu}_b$b.json" >> "$OUT/attn.log" 2>&1
    done
    echo "attn rc=$?"; tail -c 2500 "$OUT/attn.log" ;;
  credit)
    timeout 240 python experiments/bench/credit_cost.py --preset qwen3-0.6b --assigners entropy_adv entropy_fork \
      entropy_fork:scope=micro_batch,normaliser=trl,micro_batch_size=1 --out "$OUT/credit_cost_qwen3-0.6b_${card:-gpu}_in_forward.json" \
      > "$OUT/credit.log" 2>&1
    echo "credit rc=$?"; tail -c 1200 "$OUT/credit.log" ;;
  bench)
    n=${BENCH_NAME:-trl_vs_gearlab_tuned}_${card:-gpu}
    ( [ -f "$VSITE/env.sh" ] && . "$VSITE/env.sh"
      timeout ${BENCH_TIMEOUT:-560} python experiments/bench/trl_vs_gearlab.py --iters ${BENCH_ITERS:-4} --profile \
        --new ${BENCH_NEW:-0} --variant-timeout ${BENCH_VARIANT_TIMEOUT:-0} --vllm-mem ${BENCH_VLLM_MEM:-0.3} \
        --variants "${BENCH_VARIANTS:-trl_default,trl_tuned,gearlab_tuned,gearlab_fast}" \
        --out "$OUT/$n.json" --md "$OUT/$n.md" > "$OUT/$n.log" 2>&1 )
    echo "bench rc=$?"; cat "$OUT/$n.md" 2>/dev/null; tail -c 1500 "$OUT/$n.log" ;;
  vllm)
    ( . "$VSITE/env.sh" && timeout 400 python experiments/gpu/vllm_check.py --out "$OUT/vllm_check.json" > "$OUT/vllm_check.log" 2>&1 )
    echo "vllm rc=$?"; tail -c 3000 "$OUT/vllm_check.log" ;;
  varlen)
    # the issue-17 workload (5-step arithmetic, 25.3M-parameter policy warm-started on the card, bf16 autocast):
    # responses end where the model samples its stop token; a shorter warm start than issue 17's keeps the call short
    timeout ${VARLEN_TIMEOUT:-480} gearlab train experiment=arith_long_gpu warmstart.steps=200 rollout.engine=fast \
      trainer.compile=true trainer.accelerator=gpu trainer.max_steps=50 trainer.output_dir=runs/varlen \
      eval.num_problems=64 trainer.progress_bar=false > "$OUT/varlen.log" 2>&1
    echo "varlen rc=$?"
    python experiments/gpu/varlen_summary.py runs/varlen > "$OUT/varlen_summary.json"; cat "$OUT/varlen_summary.json" ;;
  auto)
    timeout ${AUTO_TIMEOUT:-240} gearlab train experiment=arith_long_gpu rollout.engine=auto warmstart.steps=50 \
      trainer.max_steps=3 trainer.output_dir=runs/auto eval.num_problems=32 trainer.progress_bar=false > "$OUT/auto.log" 2>&1
    echo "auto rc=$?"; grep -hE "^ *(engine|attention): " $(find runs/auto -name config.yaml | head -1)
    python experiments/gpu/varlen_summary.py runs/auto > "$OUT/auto_summary.json"; cat "$OUT/auto_summary.json" ;;
  rerun)
    RERUN_TIMEOUT=${RERUN_TIMEOUT:-150} rerun_pair rerun "$OUT/rerun_${card:-gpu}.json" experiment=${RERUN_EXP:-arith_long_gpu} \
      rollout.engine=auto assigner=${RERUN_ASSIGNER:-gear} ${RERUN_ARGS:-warmstart.steps=50} \
      trainer.max_steps=${RERUN_STEPS:-4} eval.num_problems=32 trainer.progress_bar=false ;;
  *) echo "unknown part $part (check | attn | auto | credit | bench | vllm | rerun | varlen)"; exit 2 ;;
  esac
done

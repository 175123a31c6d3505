#!/usr/bin/env bash
# trainer.deterministic (on by default: strict deterministic algorithms on CUDA) on the GPU paths it had not run on,
# on a lent card (device `run`, carry [".whl"]; `fsdp` needs a 2-GPU kind). Parts run in the order given:
#   methods  every credit method (conf/assigner/*.yaml) for one iteration of arith_long_gpu from its 400-step warm start,
#            rollout.engine=auto (the fast decoder, split-K attention), 3 runs per card at once: a method whose ops
#            have no deterministic CUDA kernel stops with exit 2 and one line naming trainer.deterministic
#   compile  trainer.compile=true, the same 3-iteration GEAR run twice, experiments/gpu/rerun_check.py on the pair
#   tool     multi-turn (experiment=tool_tiny on the GPU from its GPU warm start, gigpo: per-turn credit),
#            3 iterations twice, rerun_check
#   credit_eval  `gearlab credit-eval` twice on the final model of `methods`' grpo run (run `methods` first, in the
#            same call or an earlier one on the same machine): both credit_eval.json files must be equal, byte for byte
#   fsdp     1 GPU vs 2 GPUs, FSDP2, bf16-mixed: experiments/gpu/world_size_trace.sh SET=mixed (the committed
#            figures in experiments/results/world_size_gpu/ predate the flag), then SET=one (unsharded vs FSDP2 on one
#            card, with and without activation checkpointing)
# Writes $OUT/strict_<part>.json and the runs' logs ($OUT/logs/ for methods); prints a summary per part.
[[ -n ${NO_SITE:-} ]] || . experiments/gpu/site.sh  # NO_SITE=1: the current Python (a dry run on a CPU)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); (( NG > 0 )) || NG=1
# the preset's 400-step warm start (~30% greedy): from a weaker one (50 steps: 0%) every group scores alike, every
# advantage is 0 and the signal passes skip every row, so a method's kernels would not run; skip_zero_rows=false runs
# the signal passes on every row all the same
short=${STRICT_ARGS:-"experiment=arith_long_gpu rollout.engine=auto eval.num_problems=0 credit_eval.after_training=false trainer.progress_bar=false signals.skip_zero_rows=false"}

one_method() {  # $1 = assigner, $2 = card: one iteration; prints "name rc last-line"
  local a=$1 log=$OUT/logs/method_$1.log
  CUDA_VISIBLE_DEVICES=$2 timeout 300 gearlab train $short assigner="$a" trainer.max_steps=1 \
    trainer.output_dir=runs/strict_methods trainer.run_name="$a" > "$log" 2>&1
  local rc=$?
  echo "$a $rc $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-300)"
}
export -f one_method; export short OUT

. experiments/gpu/rerun_pair.sh

for part in "$@"; do
  case $part in
  methods)
    rm -rf runs/strict_methods
    one_method grpo 0 > "$OUT/methods.txt"  # makes the shared warm start first
    ls ${METHODS:-conf/assigner/*.yaml} | xargs -n1 basename | sed 's/\.yaml$//' | grep -vx grpo | awk -v n="$NG" '{print $1, (NR-1)%n}' \
      | xargs -P $((3 * NG)) -L1 bash -c 'one_method "$0" "$1"' >> "$OUT/methods.txt"
    sort "$OUT/methods.txt" | cut -c1-200
    python3 - "$OUT/methods.txt" "$OUT/strict_methods.json" <<'P'
import json, sys
rows = [l.split(" ", 2) for l in open(sys.argv[1]) if l.strip()]
res = {r[0]: {"rc": int(r[1]), "last_line": r[2].strip() if len(r) > 2 else ""} for r in rows}
json.dump(res, open(sys.argv[2], "w"), indent=1)
print("methods:", len(res), "ran:", sum(v["rc"] == 0 for v in res.values()),
      "stopped by trainer.deterministic:", [k for k, v in res.items() if "trainer.deterministic" in v["last_line"]])
P
    ;;
  compile) rerun_pair strict_compile "$OUT/strict_compile.json" $short assigner=gear trainer.compile=true trainer.max_steps=3 ;;
  tool) rerun_pair strict_tool "$OUT/strict_tool.json" experiment=tool_tiny trainer.accelerator=gpu warmstart.device=cuda assigner=gigpo trainer.max_steps=3 \
          eval.num_problems=0 credit_eval.after_training=false ;;
  credit_eval)
    final=runs/strict_methods/grpo/final
    [[ -f $final/config.json ]] || { echo "credit_eval: no $final (run the methods part first)"; exit 2; }
    for x in a b; do
      rm -rf "runs/strict_ce_$x"
      timeout 240 gearlab credit-eval $short model.name_or_path="$final" credit_eval.out_dir="runs/strict_ce_$x" \
        trainer.output_dir=runs/strict_ce > "$OUT/strict_ce_$x.log" 2>&1
      echo "credit_eval $x rc=$?"; grep -v '^\s*$' "$OUT/strict_ce_$x.log" | tail -1 | cut -c1-300
    done
    python3 - runs/strict_ce_a/credit_eval.json runs/strict_ce_b/credit_eval.json "$OUT/strict_credit_eval.json" <<'P'
import hashlib, json, sys
a, b = (open(f, "rb").read() for f in sys.argv[1:3])
rec = json.loads(a)
res = {"equal": a == b, "sha256": [hashlib.sha256(x).hexdigest() for x in (a, b)],
       "n_trajectories": rec["n_trajectories"], "n_scored": rec["n_located_informative"]}
json.dump(res, open(sys.argv[3], "w"), indent=1)
print("credit_eval repeated:", res["equal"], res["sha256"][0][:12], res["sha256"][1][:12], "responses scored:",
      res["n_scored"], "(0: nothing was scored, the equality shows little)" if not res["n_scored"] else "")
P
    ;;
  fsdp)
    SET=mixed OUT=$OUT/fsdp_mixed bash experiments/gpu/world_size_trace.sh
    SET=one OUT=$OUT/fsdp_one bash experiments/gpu/world_size_trace.sh ;;
  *) echo "unknown part $part (methods | credit_eval | compile | tool | fsdp)"; exit 2 ;;
  esac
done

#!/bin/bash
# GEAR's premise against Monte-Carlo values on a pretrained model and a natural-language task (issue 31, item 5):
# SmolLM2-135M warm-started on reasoning-gym's gsm_symbolic, its responses continued K times from every line end,
# every method's credit (and each raw signal) scored against the MC onset and against the located first wrong line.
# One call on a warm machine that has SmolLM2, reasoning-gym and the wheels installed (smollm2_rg/README.md) and
# the comparison's warm start (WS_DIR; made here with the preset's recipe if it is missing).
#   bash experiments/gpu/smollm2_premise.sh            # results under $OUT/premise_gsm/
# PROMPTS test problems × 8 responses (32), K continuations per line end (8).
set -uo pipefail
python -c "import gearlab.assigners" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OUT=${OUT:-gpu_out}
R=${RUNS:-runs}; WS_DIR=${WS_DIR:-$R/warmstart/smollm2-135m-rg}
PRESET=(experiment=smollm2_gsm_gpu trainer.output_dir=$R)
mkdir -p "$OUT/premise_gsm"
SECONDS=0
[ -f "$WS_DIR/config.json" ] || gearlab warmstart "${PRESET[@]}" > "$OUT/premise_warmstart.log" 2>&1
echo "warm start ready after ${SECONDS}s: $(python -c "import json,sys;print(json.load(open(sys.argv[1]))['weights_sha256'][:12])" "$WS_DIR/warmstart.json")"
gearlab credit-eval "${PRESET[@]}" model.name_or_path="$WS_DIR" credit_eval.truth=both credit_eval.mc_k=${K:-8} \
  credit_eval.prompts=${PROMPTS:-32} credit_eval.out_dir="$OUT/premise_gsm" \
  credit_eval.rollouts="$OUT/premise_gsm/rollouts.pt" \
  "credit_eval.assigners=[grpo,gear,gear_random,gear_fixed,rlsd,entropy_fork,oar_g,otb,ktae,grail,sdpo]" \
  > "$OUT/premise_gsm/credit_eval.log" 2>&1
echo "credit-eval rc=$? after ${SECONDS}s"
grep -v Warning "$OUT/premise_gsm/credit_eval.log" | tail -40

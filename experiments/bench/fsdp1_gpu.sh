set -uo pipefail
python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -1
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-gpu_out}
bash experiments/bench/gpu_parity_and_mfu.sh parity 2>&1 | tail -30
for s in fsdp1 fsdp2; do
  timeout 200 python experiments/bench/gear_iteration.py --shape qwen3-0.6b --devices 2 --strategy $s --iters 3 --new 128 --out $OUT/gear_06b_$s.json > $OUT/gear_$s.log 2>&1 && grep '^{' $OUT/gear_$s.log || { echo "gear $s failed"; grep -B2 -A3 -m3 -E "Error" $OUT/gear_$s.log | tail -20; }
done

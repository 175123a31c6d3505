#!/bin/bash
# Would CUDA's Multi-Process Service speed up a card that three comparison children share, without changing a bit?
# Without it the card time-slices the processes (nvidia-smi: 100% busy while each child's small kernels leave most
# of the 132 SMs idle); with it their kernels run side by side. A kernel's result does not depend on what runs next
# to it, and the device still reports all its SMs (no CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so launch configurations
# and library heuristics are unchanged: the tokens should be the same bits. This checks that, on a card:
#   bash experiments/gpu/mps_probe.sh          (device `run`, after the packages; ~2 min)
# It starts the MPS control daemon in a folder of /tmp (a process of this call, in its own session, stopped at the
# end; no setting of the card changes), runs experiments/gpu/concurrent_decode_check.py --modes sdpa (three
# processes at once, 128 rows x 256 tokens, three calls each) through it, and compares the token digest and the ms
# per decode step with the committed run without MPS (experiments/results/smollm2_rg/decode_determinism_h200_sdpa.json:
# digest 04e7c8773ade5a1d, 14.2 ms). Result: $OUT/cc_mps.json and one line, `mps: same bits ...` or why not.
# If it passes, `MPS=1 bash experiments/gpu/compare_in_calls.sh ...` runs a comparison's children through MPS.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
command -v nvidia-cuda-mps-control >/dev/null || { echo "mps: nvidia-cuda-mps-control is not on this machine"; exit 3; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
setsid nvidia-cuda-mps-control -d || { echo "mps: the control daemon did not start"; exit 3; }
sleep 2
timeout ${MPS_TIMEOUT:-240} python experiments/gpu/concurrent_decode_check.py --modes sdpa --out "$OUT/cc_mps.json" \
  > "$OUT/cc_mps.log" 2>&1
echo "concurrent_decode_check rc=$?"
echo quit | nvidia-cuda-mps-control
tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
python - "$OUT/cc_mps.json" experiments/results/smollm2_rg/decode_determinism_h200_sdpa.json <<'EOF'
import json, sys
try:
    new = json.load(open(sys.argv[1]))["sdpa"]
except (OSError, KeyError, ValueError) as e:
    sys.exit(f"mps: no result ({e})")
old = json.load(open(sys.argv[2]))["sdpa"]
dig = lambda r: {d for p in r["processes"] for d in p.get("digests", [])}
ms = lambda r: [p.get("ms_per_step_second_call") for p in r["processes"]]
same = dig(new) == dig(old) and len(dig(new)) == 1
print(f"mps: {'same bits' if same else 'DIFFERENT tokens'} (digests {sorted(dig(new))} vs {sorted(dig(old))}); "
      f"ms per decode step, three processes sharing the card: {ms(new)} with MPS, {ms(old)} without")
EOF

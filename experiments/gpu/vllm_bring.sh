#!/usr/bin/env bash
# GPU side of bringing vLLM 0.25.0 (CUDA 13 build) onto the lent GPU machine (no network), next to the image's
# torch 2.11.0+cu130, installed into /tmp/vsite. The pieces .vllm_pieces/part_NN and .vllm_pieces/SHA256SUMS are
# made on the CPU machine by experiments/gpu/vllm_pack.sh; the procedure is in experiments/gpu/vllm_pieces.md.
# One device call per piece (64 MiB a call), back to back: /tmp survives only while the machine stays warm.
#
#   bash experiments/gpu/vllm_bring.sh ACTION...      actions run in order, e.g.
#     00 | 01 | ...   copy the carried piece .vllm_pieces/part_NN to /tmp/vllm_pieces and check its sha256
#                     (the call carries [".vllm_pieces/part_NN", ".vllm_pieces/SHA256SUMS"])
#     status          which pieces of which tier are there
#     install         join the pieces of every complete tier (core is required), check, unpack, pip-install into
#                     /tmp/vsite (+ the extra tier's overlay), write /tmp/vsite/env.sh, list unmet requirements,
#                     import-check vLLM's GPU engine modules
#     smoke           a tiny random Qwen3 (gearlab.models.tiny, head_dim 128) generates with vLLM on the GPU,
#                     sleeps, wakes up and generates again
#   The last piece's call can finish the job: bash experiments/gpu/vllm_bring.sh 01 install smoke
# Afterwards, in the same or a later call (while warm): . /tmp/vsite/env.sh
# Settings: PY (python3, the image's torch python), VLLM_PIECES_DIR (/tmp/vllm_pieces), VLLM_SITE (/tmp/vsite)
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${VLLM_PIECES_DIR:-/tmp/vllm_pieces} T=${VLLM_SITE:-/tmp/vsite} PY=${PY:-python3}
mkdir -p "$D"
# the checksum list travels with each piece; a copy in $D serves calls that carry none
if [ -f .vllm_pieces/SHA256SUMS ]; then
  if [ -f "$D/SHA256SUMS" ] && ! cmp -s .vllm_pieces/SHA256SUMS "$D/SHA256SUMS"; then
    echo "note: the carried SHA256SUMS differs from an earlier call's (repacked?): earlier pieces are rechecked against it"
  fi
  cp .vllm_pieces/SHA256SUMS "$D/SHA256SUMS"
fi
SUMS=$D/SHA256SUMS
[ -f "$SUMS" ] || { echo "FAIL: no SHA256SUMS here: carry .vllm_pieces/SHA256SUMS"; exit 1; }

sum_of() { awk -v f="$1" '$2 == f {print $1}' "$SUMS"; }
ok() { [ -f "$2" ] && [ "$(sha256sum "$2" | cut -d' ' -f1)" = "$(sum_of "$1")" ]; }
tars() { awk '$2 ~ /^vllm-[a-z]+\.tar(\.xz)?$/ {print $2}' "$SUMS"; }          # tiers, in pack order
tier_of() { local t=${1#vllm-}; echo "${t%%.*}"; }
parts() { awk -v t="$1" '$2 ~ /^vllm-/ {on = ($2 == t); next} on {print $2}' "$SUMS"; }
missing() { local m=""; for p in $(parts "$1"); do ok "$p" "$D/$p" || m="$m ${p#part_}"; done; echo "$m"; }
status() { local t m; for t in $(tars); do m=$(missing "$t"); [ -n "$m" ] && m="missing$m" || m=complete
  echo "$(tier_of "$t") tier ($(parts "$t" | wc -l) pieces): $m"; done; }
env_line() { echo "export PYTHONPATH=$T\${PYTHONPATH:+:\$PYTHONPATH}"; }

install() {
  local core sel="" t m
  core=$(tars | grep '^vllm-core\.') || { echo "FAIL: SHA256SUMS names no core tier"; exit 1; }
  m=$(missing "$core"); [ -z "$m" ] || { status; echo "FAIL: core pieces missing or corrupt:$m"; exit 1; }
  for t in $(tars); do
    m=$(missing "$t")
    if [ -z "$m" ]; then sel="$sel $t"; else echo "$(tier_of "$t") tier incomplete (missing$m): not installed"; fi
  done
  echo "$($PY -V 2>&1), torch $($PY -c 'import torch; print(torch.__version__)' 2>/dev/null || echo MISSING)"
  rm -rf "$T" "$D/w"; mkdir -p "$D/w"
  for t in $sel; do
    for p in $(parts "$t"); do cat "$D/$p"; done > "$D/$t"
    ok "$t" "$D/$t" || { echo "FAIL: $t checksum after joining"; exit 1; }
    $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$D/$t" "$D/w"
    rm -f "$D/$t"
  done
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$T" "$D"/w/wheels/*.whl
  if [ -d "$D/w/overlay" ]; then cp -a "$D/w/overlay/." "$T/"; fi
  rm -rf "$D/w"
  { echo "# written by experiments/gpu/vllm_bring.sh install"; env_line
    echo "export VLLM_USE_FLASHINFER_SAMPLER=0   # no flashinfer carried"
    echo "export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1   # no network there"; } > "$T/env.sh"
  echo "installed tiers:$(for t in $sel; do printf ' %s' "$(tier_of "$t")"; done) into $T:" \
    "$(ls -d "$T"/*.dist-info | wc -l) packages; use: . $T/env.sh"
  # requirements of what was installed that the image + $T do not meet (extras ignored)
  PYTHONPATH=$T $PY - "$T" <<'EOF' || true
import sys, importlib.metadata as md
from packaging.requirements import Requirement
missing, conflicts = {}, []
for d in md.distributions(path=[sys.argv[1]]):
    for s in d.requires or []:
        r = Requirement(s)
        if r.marker and not r.marker.evaluate({"extra": ""}): continue
        try: v = md.version(r.name)
        except md.PackageNotFoundError: missing.setdefault(r.name, d.metadata["Name"]); continue
        if not r.specifier.contains(v, prereleases=True):
            conflicts.append(f"{d.metadata['Name']} wants {r}, found {v}")
print(f"not installed ({len(missing)}; vllm's optional-for-us pins, expected):", " ".join(sorted(missing)))
for c in conflicts: print("version conflict:", c)
EOF
  # import check of what the GPU engine loads (the CUDA kernels too); exit 1 only if `from vllm import LLM` fails
  # shellcheck disable=SC1091
  (. "$T/env.sh"; $PY - <<'EOF')
import importlib, traceback, torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU: {torch.cuda.is_available()}")
import vllm
from vllm import LLM, SamplingParams  # noqa: F401
print(f"vllm {vllm.__version__}: from vllm import LLM OK")
bad, mods = 0, ["vllm._C_stable_libtorch", "vllm.cumem_allocator", "vllm.vllm_flash_attn", "vllm.platforms.cuda",
          "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker",
          "vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.flash_attn",
          "vllm.v1.attention.backends.triton_attn", "vllm.model_executor.models.qwen3",
          "vllm.model_executor.model_loader.default_loader", "vllm.v1.sample.sampler", "vllm.device_allocator.cumem",
          "vllm.compilation.backends", "vllm.v1.structured_output"]
for m in mods:
    try:
        importlib.import_module(m)
    except BaseException as e:  # noqa: BLE001
        bad += 1; print(f"  import FAILED {m}: {type(e).__name__}: {e}")
print(f"imports: {len(mods) - bad}/{len(mods)} OK")
try:
    from vllm.vllm_flash_attn import flash_attn_interface as fa
    print(f"FlashAttention 3 kernels: {'loaded' if fa.FA3_AVAILABLE else 'NOT loaded: ' + str(fa.FA3_UNAVAILABLE_REASON)};"
          f" FA2: {'loaded' if fa.FA2_AVAILABLE else 'absent (extra tier)'}")
except ImportError as e:
    print(f"FlashAttention kernels: NOT loaded: {e}")
from vllm.platforms import current_platform
print(f"platform: {type(current_platform).__name__}")
EOF
}

smoke() {
  # shellcheck disable=SC1091
  . "$T/env.sh"
  PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 $PY - <<'EOF'
import tempfile, time
t0 = time.time()
from gearlab.models.tiny import build_tiny_model, build_tokenizer
d = tempfile.mkdtemp(prefix="tinyqwen3_")
tok = build_tokenizer()  # head_dim 128 as in every Qwen3 (the embedded default has 32)
build_tiny_model(tok, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512,
                 seed=0).save_pretrained(d)
tok.save_pretrained(d)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=d, tokenizer=d, max_model_len=256, enforce_eager=True, seed=0, dtype="bfloat16",
          logprobs_mode="processed_logprobs", gpu_memory_utilization=0.2, enable_sleep_mode=True)
print(f"engine up in {time.time() - t0:.0f} s")
ids = tok("12+7=")["input_ids"]
def run(greedy):
    sp = SamplingParams(max_tokens=12, temperature=0.0 if greedy else 1.0, logprobs=0, seed=1, detokenize=False)
    o = llm.generate([TokensPrompt(prompt_token_ids=ids)] * 2, sp, use_tqdm=False)[0].outputs[0]
    return list(o.token_ids), [round(float(s[t].logprob), 3) for s, t in zip(o.logprobs, o.token_ids)]
print("sampled:", *run(False))
g1 = run(True); print("greedy: ", *g1)
llm.sleep(level=1); llm.wake_up()
g2 = run(True); print("after sleep/wake_up, greedy tokens equal:", g1[0] == g2[0])
print(f"SMOKE OK in {time.time() - t0:.0f} s")
EOF
}

[ $# -gt 0 ] || { sed -n 2,19p "$0"; exit 2; }
for a in "$@"; do
  case "$a" in
    install) install ;;
    smoke) smoke ;;
    status) status ;;
    [0-9]|[0-9][0-9])
      p=part_$(printf %02d $((10#$a))); f=.vllm_pieces/$p
      [ -n "$(sum_of "$p")" ] || { echo "FAIL: $p is not in SHA256SUMS"; exit 1; }
      if [ -f "$f" ]; then cp "$f" "$D/$p"; elif [ -f "$D/$p" ]; then echo "$p not carried; checking the copy in $D"
      else echo "FAIL: $f not carried (and not in $D)"; exit 1; fi
      ok "$p" "$D/$p" && echo "$p OK ($(du -m --apparent-size "$D/$p" | cut -f1) MiB)" \
        || { rm -f "$D/$p"; echo "FAIL: $p checksum"; exit 1; }
      status ;;
    *) echo "unknown action $a"; sed -n 2,19p "$0"; exit 2 ;;
  esac
done

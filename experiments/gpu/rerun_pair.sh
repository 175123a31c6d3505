# Sourced by the GPU scripts. rerun_pair NAME JSON OVERRIDES...: the same `gearlab train OVERRIDES` twice, each in
# its own process and output folder (runs/NAME_a, runs/NAME_b; logs $OUT/NAME_a.log, $OUT/NAME_b.log), then
# experiments/gpu/rerun_check.py writes JSON: every iteration's rollout crc, rewards, credit and update must be equal.
# RERUN_TIMEOUT bounds each run (seconds, default 280). Prints each run's exit code and last log line.
rerun_pair() {
  local name=$1 json=$2 x log; shift 2
  for x in a b; do
    log=$OUT/${name}_$x.log
    timeout "${RERUN_TIMEOUT:-280}" gearlab train "$@" trainer.output_dir="runs/${name}_$x" > "$log" 2>&1
    echo "$name $x rc=$?"; grep -v '^\s*$' "$log" | tail -1 | cut -c1-300
  done
  python experiments/gpu/rerun_check.py "runs/${name}_a" "runs/${name}_b" --out "$json"
  echo "$name rerun_check rc=$?"
}

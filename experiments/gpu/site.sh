# Source this on the GPU machine (device `run`, carry [".whl"]): gearlab's run-time wheels into /tmp/site and gearlab
# itself (editable) into the image's Python, once per machine (a marker file; scripts run side by side share it,
# and a warm machine's second call skips the ~20 s install); then PYTHONPATH=/tmp/site:<repo>.
#   . experiments/gpu/site.sh
if [ ! -f /tmp/site/.gearlab-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 && touch /tmp/site/.gearlab-installed
fi
export PYTHONPATH=/tmp/site:$PWD

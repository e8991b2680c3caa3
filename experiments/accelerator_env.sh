#!/usr/bin/env bash
# A venv equivalent to the GPU check machines' image, on a CPU machine: Python 3.12 with the
# pins of requirements-accelerator.txt (jax/jaxlib 0.11.2, the image's flax/optax/orbax/chex/...,
# the small wheels carried to the image: clu, ml-collections, dm-pix; pytest and its plugins),
# and this repo installed editable WITHOUT its declared dependencies (they include tensorflow,
# which the image lacks).  No tensorflow, tensorflow-datasets, torch or timm.
#
#   bash experiments/accelerator_env.sh [VENV]        # VENV defaults to .venv-accel in the repo root
#   XLA_FLAGS=--xla_force_host_platform_device_count=8 \
#     .venv-accel/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_layers.py
#
# Idempotent: an existing venv whose installed versions already match every pin (and that has
# this repo installed editable) is reused without calling pip; one that differs is brought to
# the pins by `pip install -r`; one that is not a working Python 3.12 venv is recreated.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv-accel}
REQ=$ROOT/requirements-accelerator.txt

# Python 3.12: on PATH, else pyenv's versions folder (its shim on PATH may exist and still fail
# when 3.12 is not the selected pyenv version, hence the check that each candidate runs).
is_py312() { [ -n "$1" ] && [ -x "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
find_python312() {
  local candidate pyenv_root
  candidate=$(command -v python3.12 || true)
  if is_py312 "$candidate"; then echo "$candidate"; return 0; fi
  pyenv_root=$( (command -v pyenv >/dev/null && pyenv root) 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for candidate in $(ls -d "$pyenv_root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
    if is_py312 "$candidate"; then echo "$candidate"; return 0; fi
  done
  return 1
}

# pip, quiet; without the warnings this machine's pip config prints for absent local indexes.
pip_q() {
  "$VPY" -m pip --disable-pip-version-check "$@" -q 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

# Exit 0 when every pin of $REQ is the installed version and smoothing_jax imports from $ROOT.
satisfied() {
  "$VPY" -I - "$ROOT" "$REQ" <<'EOF'
import importlib.metadata as md, importlib.util, os, re, sys
root, req = sys.argv[1], sys.argv[2]
wrong = []
for line in open(req):
  line = line.split("#", 1)[0].strip()
  if not line:
    continue
  m = re.fullmatch(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?==(\S+)", line)
  if not m:
    sys.exit(f"{req}: not a NAME==VERSION pin: {line}")
  name, _, version = m.groups()
  try:
    have = md.version(name)
  except md.PackageNotFoundError:
    have = None
  if have != version:
    wrong.append(f"{name} {have} (pin {version})")
spec = importlib.util.find_spec("smoothing_jax")
if spec is None or not os.path.realpath(spec.origin).startswith(os.path.join(os.path.realpath(root), "")):
  wrong.append(f"smoothing_jax not installed from {root}")
if wrong:
  print("accelerator_env: to update: " + ", ".join(wrong))
sys.exit(1 if wrong else 0)
EOF
}

VPY=$VENV/bin/python
fresh=0
if ! is_py312 "$VPY"; then
  PY312=$(find_python312) || { echo "accelerator_env: no working python3.12 found (PATH or \$(pyenv root)/versions/3.12*)" >&2; exit 1; }
  echo "accelerator_env: creating $VENV with $PY312"
  "$PY312" -m venv --clear "$VENV"
  fresh=1
fi
# Git ignores the venv wherever it is (as Python 3.13's venv does), whatever .gitignore says.
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"

if [ "$fresh" = 0 ] && satisfied; then
  echo "accelerator_env: $VENV already matches $(basename "$REQ")"
else
  pip_q install -r "$REQ"
  pip_q install --no-deps -e "$ROOT"
  satisfied || { echo "accelerator_env: $VENV still differs from $REQ after pip install" >&2; exit 1; }
  echo "accelerator_env: $VENV ready"
fi

# The image has neither tensorflow nor (in this venv) torch: nothing may pull them in.
"$VPY" -I -c 'import importlib.util as u, sys; bad = [m for m in ("tensorflow", "torch") if u.find_spec(m)]; sys.exit(f"accelerator_env: importable but must not be: {bad}" if bad else 0)'

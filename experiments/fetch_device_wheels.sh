#!/usr/bin/env bash
# Wheels that the GPU check machines' image lacks and our code needs there, downloaded for the
# image's Python 3.12 on Linux x86_64 into a git-ignored folder (default .whl/ in the repo root;
# the first argument overrides):  clu, ml-collections, dm-pix (pinned in
# requirements-accelerator.txt) and pyhessian (pinned in requirements-test.txt; it needs torch,
# which the image has).  All are pure Python, and so are their dependencies the image lacks:
# none today (the check below fails, naming it, if a pin ever brings one).
#
# Carry the folder to the device machine (run's `carry: [".whl"]`) and install there with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Idempotent: wheels already in the folder are not downloaded again, and wheels of other
# versions of these packages (left by an older pin) are removed, so that *.whl holds one each.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/.whl}
PACKAGES=(clu ml-collections dm-pix pyhessian)
PIN_FILES=("$ROOT/requirements-accelerator.txt" "$ROOT/requirements-test.txt")
MAX_MIB=32  # the device run's `carry` takes 64 MiB in all

# NAME==VERSION from the first pin file that pins NAME.
pin() {
  local line
  line=$(grep -h -i -m1 -E "^$1(\[[^]]*\])?==" "${PIN_FILES[@]}" | head -n1 || true)
  [ -n "$line" ] || { echo "fetch_device_wheels: no NAME==VERSION pin for $1 in ${PIN_FILES[*]}" >&2; exit 1; }
  echo "${line%%#*}" | sed -E 's/\[[^]]*\]//; s/[[:space:]]+$//'
}

PINS=()
for name in "${PACKAGES[@]}"; do PINS+=("$(pin "$name")"); done

mkdir -p "$DEST"
# Git ignores the folder wherever it is, whatever .gitignore says (`*.whl` skips this file).
[ -f "$DEST/.gitignore" ] || echo '*' > "$DEST/.gitignore"
quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }  # this machine's absent indexes
for spec in "${PINS[@]}"; do
  if ! quiet python3 -m pip --disable-pip-version-check download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      -d "$DEST" "$spec"; then
    # Only an sdist (pyhessian may be one): build the wheel here; it must be pure Python.
    echo "fetch_device_wheels: no wheel of $spec: building one from its sdist"
    quiet python3 -m pip --disable-pip-version-check wheel -q --no-deps -w "$DEST" "$spec"
    name=${spec%%==*}
    if ls "$DEST"/*.whl | grep -i -E "/${name//[-_.]/[-_.]}-${spec#*==}-" | grep -v -q -- "-py3-none-any.whl$"; then
      echo "fetch_device_wheels: the wheel built for $spec is not pure Python" >&2
      exit 1
    fi
  fi
done

# Remove stale versions; check that every wheel's Requires-Dist is in the image or fetched here.
python3 - "$DEST" "${PINS[@]}" <<'EOF'
import pathlib, re, sys, zipfile
from pip._vendor.packaging.requirements import Requirement

IMAGE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
             "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
             "implementation_name": "cpython", "platform_python_implementation": "CPython",
             "extra": ""}

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
dest, pins = pathlib.Path(sys.argv[1]), sys.argv[2:]
wanted = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
# The image's packages (the brief of the GPU machines), and what flax/orbax-checkpoint there
# install with them: pyyaml, and etils' epath extra (fsspec, importlib_resources, zipp).
image = {norm(n) for n in """absl-py etils flax jax jaxlib numpy scipy packaging typing-extensions
    wrapt chex protobuf optax orbax-checkpoint matplotlib scikit-learn pillow tensorboard torch timm
    ml-dtypes pyyaml msgpack fsspec importlib-resources zipp""".split()}
missing = []
for wheel in sorted(dest.glob("*.whl")):
  name, version = wheel.name.split("-")[:2]
  if wanted.get(norm(name)) != version:
    print(f"fetch_device_wheels: removing {wheel.name} (not a pinned version)")
    wheel.unlink()
    continue
  with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
    requires = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines()
                if l.startswith("Requires-Dist:")]
  for req in requires:
    req = Requirement(req)
    if req.marker and not req.marker.evaluate(IMAGE_ENV):
      continue  # an optional extra, or another platform's dependency
    dep = norm(req.name)
    if dep not in image and dep not in wanted:
      missing.append(f"{wheel.name} requires {req}")
have = {norm(w.name.split("-")[0]) for w in dest.glob("*.whl")}
for name in sorted(set(wanted) - have):
  missing.append(f"no wheel for {name}=={wanted[name]} in {dest}")
if missing:
  sys.exit("fetch_device_wheels: the image lacks these; pin and add them to PACKAGES:\n  "
           + "\n  ".join(missing))
EOF

bytes=$(cat "$DEST"/*.whl | wc -c)
ls -l "$DEST"/*.whl | awk '{print "  " $5 "  " $NF}'
echo "fetch_device_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((bytes / 1024)) KiB in $DEST"
if [ "$bytes" -gt $((MAX_MIB * 1024 * 1024)) ]; then
  echo "fetch_device_wheels: over $MAX_MIB MiB: too much for the device run's carry" >&2
  exit 1
fi

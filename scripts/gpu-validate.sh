#!/bin/bash
# Validate robustd on a host with a real NVIDIA GPU and driver, in at most 5 minutes, with no build tools.
#
# Here (the build machine):   scripts/gpu-validate.sh wheelhouse [DIR]     (default build/gpu-wheelhouse)
#   the pinned runtime wheels (manylinux, CPython 3.11-3.13: packaging/fetch-wheels.sh) and their
#   requirements.txt, about 35 MiB. Copy the checkout with DIR to the GPU host.
# On the GPU host:            scripts/gpu-validate.sh [--wheelhouse DIR] [--torch-python PY] [--out FILE] [--skip STEPS]
#   makes a venv from the wheelhouse with the host's python3.11/3.12/3.13 (offline: pip --no-index),
#   runs bench/gpu_validate.py from this checkout (no install, no make) and prints its summary table
#   (its nvml step reads every field the GPU check polls, the NVLink fabric info among them, and the
#   settings the diagnostics restore after a run (clocks, power limits, persistence, compute, ECC, MIG
#   modes), and names the ones this GPU and driver answer NOT_SUPPORTED: a PCIe card's fabric state is one);
#   the JSON goes to --out (default ./gpu-validate.json). torch is not in the wheelhouse: the diagnostics
#   and tracer children use an interpreter with CUDA torch (--torch-python, $TORCH_PYTHON or python3).
# Exit status: 0 all steps PASS or SKIP, 1 a step FAILed, 2 set-up failed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")

if [ "${1:-}" = wheelhouse ]; then
  out=${2:-$repo/build/gpu-wheelhouse}
  cache=${ROBUSTD_PKG_CACHE:-$repo/build/pkg-cache}/wheels
  "$repo/packaging/fetch-wheels.sh" "$cache"
  rm -rf "$out" && mkdir -p "$out"
  # Only what the daemon and robustctl need: robustd-k8s's client (kubernetes and the ~20 MiB it pulls in)
  # plays no part in the validation, and the checkout plus wheelhouse must fit a 64 MiB copy.
  grep -Ev '^kubernetes==' "$cache/requirements.txt" > "$out/requirements.txt"
  for v in 3.11 3.12 3.13; do
    "$repo/.venv/bin/python" -m pip download -q --disable-pip-version-check --no-index --find-links "$cache" \
      --only-binary=:all: --dest "$out" --implementation cp --python-version "$v" \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
      -r "$out/requirements.txt"
  done
  du -sh "$out" | sed 's/\t.*/ wheelhouse: /' | tr -d '\n'; echo "$out"
  exit 0
fi

wheelhouse=$repo/build/gpu-wheelhouse
venv=${GPU_VALIDATE_VENV:-${TMPDIR:-/tmp}/robustd-gpu-validate-venv}
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --wheelhouse) wheelhouse=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
[ -f "$wheelhouse/requirements.txt" ] || { echo "gpu-validate: no wheelhouse at $wheelhouse (run 'scripts/gpu-validate.sh wheelhouse' on the build machine)" >&2; exit 2; }

py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in python3.11 python3.12 python3.13 python3; do
    p=$(command -v "$c" 2>/dev/null) || continue
    "$p" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' && { py=$p; break; }
  done
fi
[ -n "$py" ] || { echo "gpu-validate: needs Python 3.11, 3.12 or 3.13 (the wheelhouse's); set PYTHON=" >&2; exit 2; }

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import grpc, pynvml, pydantic, yaml' 2>/dev/null; then
  rm -rf "$venv"
  "$py" -m venv "$venv" || { echo "gpu-validate: '$py -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 2; }
  # systemd-python is built for the build machine's glibc and optional to robustd: left out here.
  grep -v '^systemd-python==' "$wheelhouse/requirements.txt" > "$venv/requirements.txt"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheelhouse" \
    -r "$venv/requirements.txt" || { echo "gpu-validate: installing from $wheelhouse failed" >&2; exit 2; }
fi
cd "$repo"
PYTHONPATH=$repo exec timeout --kill-after=10 300 "$venv/bin/python" bench/gpu_validate.py "${args[@]}"

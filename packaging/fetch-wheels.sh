#!/bin/bash
# Fill a wheel directory with robustd's pinned runtime dependencies for every supported CPython,
# as manylinux wheels (no build-machine paths, installable offline on the target).
#   packaging/fetch-wheels.sh OUTDIR
# Excluded: torch (diagnostics children only; see README "Install") and systemd-python (no wheel on
# PyPI: built here with `pip wheel` for each interpreter found, so it matches this machine's glibc).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
out=$1
PY_VERSIONS=${PY_VERSIONS:-"3.11 3.12 3.13"}
PIP=${PIP:-"$repo/.venv/bin/python -m pip"}
# The cache is for one requirements.txt: when the pins change, start over (no stale wheels bundled).
key=$(cat "$repo/requirements.txt" <(echo "$PY_VERSIONS") | sha256sum | cut -c1-16)
[ -e "$out/.key-$key" ] || rm -rf "$out"
mkdir -p "$out"
touch "$out/.key-$key"
reqs="$out/requirements.txt"
grep -Ev '^\s*(#|$)|^(torch|systemd-python)==' "$repo/requirements.txt" > "$reqs"
for v in $PY_VERSIONS; do
  stamp="$out/.fetched-$v"
  [ -e "$stamp" ] && continue
  $PIP download -q --disable-pip-version-check --only-binary=:all: --dest "$out" \
    --implementation cp --python-version "$v" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -r "$reqs"
  touch "$stamp"
done
# systemd-python: sdist only on PyPI. Build one wheel per interpreter available here (pyenv or system).
sdver=$(sed -n 's/^systemd-python==//p' "$repo/requirements.txt")
for v in $PY_VERSIONS; do
  tag=cp${v/./}
  ls "$out"/systemd_python-"$sdver"-"$tag"-*.whl >/dev/null 2>&1 && continue
  py=""
  for c in "$HOME/.pyenv/versions/$v"*/bin/python"$v" "/usr/bin/python$v"; do
    [ -x "$c" ] && { py=$c; break; }
  done
  if [ -z "$py" ]; then echo "fetch-wheels: no python$v here: no systemd-python wheel for $tag" >&2; continue; fi
  tmp=$(mktemp -d)
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-binary=:all: -w "$tmp" "systemd-python==$sdver"
  mv "$tmp"/*.whl "$out"/
  rm -rf "$tmp"
done

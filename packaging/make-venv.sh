#!/bin/sh
# Installed as /opt/robustd/make-venv.sh; run by the deb postinst and the rpm %post.
# (Re)creates the private virtualenv /opt/robustd from the bundled wheels, offline, on the
# target's own Python (3.11, 3.12 or 3.13: the versions wheels are bundled for).
set -e
PREFIX=/opt/robustd
WHEELS=$PREFIX/wheels
VERSION=$(cat "$WHEELS/VERSION")
PY=""
# The distribution's interpreters only (never one on root's PATH such as pyenv or /usr/local).
for p in /usr/bin/python3 /usr/bin/python3.13 /usr/bin/python3.12 /usr/bin/python3.11; do
    [ -x "$p" ] || continue
    v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue
    case "$v" in 3.11|3.12|3.13) PY=$p; break ;; esac
done
if [ -z "$PY" ]; then
    echo "robustd: no python3.11, 3.12 or 3.13 found; cannot create $PREFIX" >&2
    exit 1
fi
# Remove the previous environment, never the package's own files (wheels/, make-venv.sh).
rm -rf "$PREFIX/bin" "$PREFIX/lib" "$PREFIX/lib64" "$PREFIX/include" "$PREFIX/share" "$PREFIX/pyvenv.cfg"
"$PY" -m venv "$PREFIX"
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1
pip() { "$PREFIX/bin/python" -m pip -q install --no-index --find-links "$WHEELS" "$@"; }
pip -r "$WHEELS/requirements.txt"
# systemd-python is built on the package build machine for its glibc; where it does not install or
# load, robustd sends sd_notify datagrams itself and logs to stderr (the journal still gets it).
if ! pip "systemd-python" || ! "$PREFIX/bin/python" -c 'import systemd.daemon, systemd.journal' 2>/dev/null; then
    echo "robustd: WARNING: the bundled systemd-python does not load with $PY; robustd falls back to" >&2
    echo "robustd: plain sd_notify and stderr logging (pip install systemd-python into $PREFIX for journald fields)" >&2
fi
pip --no-deps "robustd==$VERSION"
"$PREFIX/bin/robustd" --version >/dev/null

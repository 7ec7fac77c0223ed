#!/bin/bash
# Build robustd's .deb or .rpm.
#   packaging/build.sh deb|rpm [OUTDIR]      (default OUTDIR: dist/)
# Version: robustd/__init__.py __version__ (ROBUSTD_VERSION=X.Y.Z overrides it; the override is
# written into the packaged robustd/__init__.py too, so `robustd --version` always equals the
# package version). RELEASE (default 1) is the package release.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
kind=${1:?usage: build.sh deb|rpm [OUTDIR]}
outdir=$(mkdir -p "${2:-$repo/dist}" && cd "${2:-$repo/dist}" && pwd)
release=${RELEASE:-1}
cache=$repo/build/pkg-cache
work=$(mktemp -d "$repo/build/pkg-$kind.XXXXXX" 2>/dev/null || { mkdir -p "$repo/build"; mktemp -d "$repo/build/pkg-$kind.XXXXXX"; })
trap 'rm -rf "$work"' EXIT
PYBIN=$repo/.venv/bin/python

# 1. The source as git sees it (tracked + untracked, not ignored), with the version stamped in.
src=$work/src
mkdir -p "$src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md robustd checks stoptests etc systemd man packaging/completion | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"; done | xargs -0 cp -d --parents -t "$src")
version=${ROBUSTD_VERSION:-$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$src/robustd/__init__.py")}
[[ $version =~ ^[0-9]+(\.[0-9]+)*([a-z0-9.+~]*)$ ]] || { echo "bad version: $version" >&2; exit 1; }
sed -i "s/^__version__ = .*/__version__ = \"$version\"/" "$src/robustd/__init__.py"

# 2. Wheels: the dependencies (cached) and robustd itself.
"$here/fetch-wheels.sh" "$cache/wheels"
wheels=$work/wheels
mkdir -p "$wheels"
cp "$cache"/wheels/*.whl "$cache/wheels/requirements.txt" "$wheels"/
(cd "$src" && "$PYBIN" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$wheels" . )
rm -rf "$src/build"
echo "$version" > "$wheels/VERSION"

# 3. The installed tree (everything but the venv, which postinst/%post creates from the wheels).
stage() {  # stage ROOT UNITDIR ZSHDIR
    local root=$1 unitdir=$2 zshdir=$3
    install -d "$root/opt/robustd/wheels" "$root/usr/bin" "$root/etc/robustd" "$root$unitdir" \
        "$root/usr/share/robustd/proto" "$root/usr/share/doc/robustd"
    install -m 0644 "$wheels"/* "$root/opt/robustd/wheels/"
    install -m 0755 "$here/make-venv.sh" "$root/opt/robustd/make-venv.sh"
    for b in robustd robustctl robustd-slurm robustd-k8s; do
        printf '#!/bin/sh\nexec /opt/robustd/bin/%s "$@"\n' "$b" > "$root/usr/bin/$b"
        chmod 0755 "$root/usr/bin/$b"
    done
    install -m 0644 "$src/etc/robustd.yaml" "$root/etc/robustd/robustd.yaml"
    install -m 0644 "$src/systemd/robustd.service" "$root$unitdir/robustd.service"
    install -m 0644 "$src/systemd/robustd-slurm.service" "$root$unitdir/robustd-slurm.service"  # disabled by default
    install -m 0644 "$src/systemd/robustd-k8s.service" "$root$unitdir/robustd-k8s.service"  # disabled by default
    # slurm.conf takes a program path without arguments: HealthCheckProgram=/usr/lib/robustd/slurm/healthcheck, ...
    install -d "$root/usr/lib/robustd/slurm"
    for h in healthcheck prolog epilog epilog-ctld prolog-ctld; do  # the last two: EpilogSlurmctld, PrologSlurmctld
        printf '#!/bin/sh\n# For slurm.conf (README "Slurm"): robustctl slurm %s\nexec /usr/bin/robustctl slurm %s "$@"\n' \
            "$h" "$h" > "$root/usr/lib/robustd/slurm/$h"
        chmod 0755 "$root/usr/lib/robustd/slurm/$h"
    done
    install -m 0644 "$src"/robustd/api/v1/*.proto "$root/usr/share/robustd/proto/"
    install -m 0644 "$src/README.md" "$root/usr/share/doc/robustd/README.md"
    # Man pages (man/, `make man`: one per console script) and robustctl's bash and zsh completion.
    install -d "$root/usr/share/man/man1" "$root/usr/share/man/man8" "$root/usr/share/bash-completion/completions" \
        "$root$zshdir"
    for m in "$src"/man/*.[18]; do
        gzip -9n -c "$m" > "$root/usr/share/man/man${m##*.}/$(basename "$m").gz"
        chmod 0644 "$root/usr/share/man/man${m##*.}/$(basename "$m").gz"
    done
    install -m 0644 "$src/packaging/completion/robustctl" "$root/usr/share/bash-completion/completions/robustctl"
    install -m 0644 "$src/packaging/completion/robustctl" "$root$zshdir/_robustctl"
}

if [ "$kind" = deb ]; then
    root=$work/deb
    stage "$root" /lib/systemd/system /usr/share/zsh/vendor-completions
    sed "s/@VERSION@/$version-$release/" "$here/deb/changelog.in" | gzip -9n > "$root/usr/share/doc/robustd/changelog.Debian.gz"
    install -m 0644 "$here/deb/copyright" "$root/usr/share/doc/robustd/copyright"
    install -D -m 0644 "$here/deb/lintian-overrides" "$root/usr/share/lintian/overrides/robustd"
    install -d "$root/DEBIAN"
    size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
    sed -e "s/@VERSION@/$version-$release/" -e "s/@SIZE@/$size/" "$here/deb/control.in" > "$root/DEBIAN/control"
    install -m 0644 "$here/deb/conffiles" "$root/DEBIAN/conffiles"
    for s in postinst prerm postrm; do install -m 0755 "$here/deb/$s" "$root/DEBIAN/$s"; done
    (cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) > "$root/DEBIAN/md5sums"
    chmod 0644 "$root/DEBIAN/md5sums"
    out="$outdir/robustd_${version}-${release}_amd64.deb"
    dpkg-deb --root-owner-group -Zgzip --build "$root" "$out" >/dev/null
elif [ "$kind" = rpm ]; then
    top=$work/rpmbuild
    mkdir -p "$top"/{BUILD,RPMS,SOURCES,SPECS,SRPMS}
    stage "$top/stage" /usr/lib/systemd/system /usr/share/zsh/site-functions
    rpmbuild -bb --quiet \
        --define "_topdir $top" --define "_unitdir /usr/lib/systemd/system" \
        --define "stage $top/stage" --define "pkgversion $version" --define "pkgrelease $release" \
        --define "_build_id_links none" --define "__os_install_post %{nil}" --define "debug_package %{nil}" \
        --define "_binary_payload w9.gzdio" \
        "$here/rpm/robustd.spec" >/dev/null
    out="$outdir/$(basename "$top"/RPMS/x86_64/robustd-*.rpm)"
    mv "$top"/RPMS/x86_64/robustd-*.rpm "$out"
else
    echo "usage: build.sh deb|rpm [OUTDIR]" >&2; exit 2
fi
echo "$out"

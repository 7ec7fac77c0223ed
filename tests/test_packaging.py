"""The deb and rpm packages (packaging/, `make deb`, `make rpm`) and the systemd unit.

Root and slow (about 60 s with the wheel cache in build/pkg-cache warm, about 90 s cold, when the
wheels are downloaded once): select with `pytest tests/test_packaging.py` or `-m root`. The deb is
really installed on this machine (dpkg -i), run, upgraded, removed and purged; the rpm is built,
inspected, unpacked into a temporary root, and installed/upgraded/erased here with its scriptlets
and a private rpm database. A robustd package already installed here is purged first.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from conftest import IN_CI, REPO, need_root

pytestmark = pytest.mark.root

BUILD = REPO / "packaging" / "build.sh"
UNIT = REPO / "systemd" / "robustd.service"
SLURM_UNIT = REPO / "systemd" / "robustd-slurm.service"  # installed, never enabled by the package
VERSION = re.search(r'__version__ = "([^"]+)"', (REPO / "robustd" / "__init__.py").read_text()).group(1)
BUMPED = VERSION + ".1"  # sorts after VERSION for dpkg, rpm and pip alike
# What an installed file must never mention: the build machine's home, its pyenv, this checkout.
FORBIDDEN = re.compile(rb"(?<![\w./-])/root(?=$|[/\"' :\n])|\.pyenv|" + re.escape(str(REPO).encode()))
UNITS = ("robustd.service", "robustd-slurm.service")
DEB_FILES = {
    "/etc/robustd/robustd.yaml", "/opt/robustd/make-venv.sh",
    "/opt/robustd/wheels/requirements.txt", "/opt/robustd/wheels/VERSION", "/usr/bin/robustd",
    "/usr/bin/robustctl", "/usr/bin/robustd-slurm", "/usr/share/robustd/proto/robustd.proto",
    "/usr/share/doc/robustd/README.md", *(f"/lib/systemd/system/{u}" for u in UNITS),
    *(f"/usr/lib/robustd/slurm/{h}" for h in ("healthcheck", "prolog", "epilog", "epilog-ctld", "prolog-ctld")),
}
RPM_FILES = (DEB_FILES - {f"/lib/systemd/system/{u}" for u in UNITS}) | {f"/usr/lib/systemd/system/{u}" for u in UNITS}
# Man pages (man/, `make man`: one per console script) and robustctl's bash and zsh completion.
MAN_PAGES = {p.name: f"/usr/share/man/man{p.suffix[1:]}/{p.name}.gz" for p in sorted((REPO / "man").glob("*.[18]"))}
BASH_COMPLETION = "/usr/share/bash-completion/completions/robustctl"
DEB_FILES |= {*MAN_PAGES.values(), BASH_COMPLETION, "/usr/share/zsh/vendor-completions/_robustctl"}
RPM_FILES |= {*MAN_PAGES.values(), BASH_COMPLETION, "/usr/share/zsh/site-functions/_robustctl"}
LEFTOVERS = ["/opt/robustd", "/etc/robustd", "/var/lib/robustd", "/usr/bin/robustd", "/usr/bin/robustctl",
             "/usr/bin/robustd-slurm", "/lib/systemd/system/robustd.service",
             "/lib/systemd/system/robustd-slurm.service", "/usr/share/robustd", "/usr/lib/robustd"]


def sh(*cmd: str | Path, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", **kw.pop("env", {})}
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, env=env, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def have(tool: str, apt_package: str) -> None:
    """Install a missing build tool from apt (root only); fail under CI, skip elsewhere, if impossible."""
    if shutil.which(tool):
        return
    if shutil.which("apt-get"):
        sh("apt-get", "update", "-qq", check=False)
        sh("apt-get", "install", "-y", "-qq", apt_package, check=False)
    if not shutil.which(tool):
        (pytest.fail if IN_CI else pytest.skip)(f"{tool} (apt package {apt_package}) is not available")


def forbidden_mentions(root: Path) -> list[str]:
    """Text files under root (and text members of wheels) that mention the build machine."""
    bad = []
    for f in root.rglob("*"):
        if f.is_symlink() or not f.is_file():
            continue
        if f.suffix == ".whl":
            if not f.name.startswith("robustd-"):
                continue  # third-party wheels come from PyPI as they are
            with zipfile.ZipFile(f) as z:
                for name in z.namelist():
                    data = z.read(name)
                    if b"\0" not in data and FORBIDDEN.search(data):
                        bad.append(f"{f}!{name}")
            continue
        data = f.read_bytes()
        if b"\0" not in data and FORBIDDEN.search(data):
            bad.append(str(f))
    return bad


def purge() -> None:
    if sh("dpkg", "-s", "robustd", check=False).returncode == 0:
        sh("dpkg", "--purge", "robustd")


def dpkg_install(deb: Path) -> None:
    p = sh("dpkg", "-i", deb, check=False)
    if p.returncode != 0:  # missing dependencies: let apt fetch them, as an operator would
        sh("apt-get", "install", "-f", "-y", "-qq")
    assert sh("dpkg-query", "-W", "-f", "${Status} ${Version}", "robustd").stdout.startswith("install ok installed")


@pytest.fixture(scope="module")
def out() -> Iterator[Path]:
    need_root("installing the robustd package")
    have("dpkg-deb", "dpkg")
    have("rpmbuild", "rpm")
    d = Path(tempfile.mkdtemp(prefix="robustd-pkg-"))
    yield d
    purge()
    shutil.rmtree(d, ignore_errors=True)


def make_package(kind: str, into: Path) -> Path:
    """`make deb|rpm` into a directory; prints the build time and size (the package's footprint)."""
    t = time.monotonic()
    p = sh("make", "-s", "-C", REPO, kind, f"PKG_DIR={into}")
    path = Path(p.stdout.strip().splitlines()[-1])
    print(f"make {kind}: {time.monotonic() - t:.1f}s, {path.stat().st_size / 2**20:.1f} MiB")
    return path


@pytest.fixture(scope="module")
def deb(out: Path) -> Path:
    path = make_package("deb", out / "v1")
    assert path.name == f"robustd_{VERSION}-1_amd64.deb"
    return path


def test_deb_contents(deb: Path, out: Path) -> None:
    listing = sh("dpkg-deb", "-c", deb).stdout
    paths = {line.split()[-1].lstrip(".") for line in listing.splitlines()}
    assert paths >= DEB_FILES, DEB_FILES - paths
    assert any(re.match(rf"/opt/robustd/wheels/robustd-{re.escape(VERSION)}-py3-none-any\.whl$", p) for p in paths)
    for dist in ("cp311", "cp312", "cp313"):
        assert any("grpcio-" in p and f"-{dist}-" in p for p in paths), f"no grpcio wheel for {dist}"
        assert any("systemd_python-" in p and f"-{dist}-" in p for p in paths), f"no systemd-python for {dist}"
    assert not any("/torch" in p for p in paths), "torch is not bundled (README: Install)"
    assert not any(p.startswith(("/var/", "/run/", "/opt/robustd/bin", "/opt/robustd/lib/")) for p in paths)

    info = sh("dpkg-deb", "-I", deb).stdout
    assert f"Version: {VERSION}-1" in info
    assert re.search(r"Depends: .*python3 \(>= 3\.11\).*python3-venv", info)
    for script in ("postinst", "prerm", "postrm", "conffiles"):
        assert script in info
    assert sh("dpkg-deb", "-f", deb, "Package").stdout.strip() == "robustd"

    x = out / "x-deb"
    sh("dpkg-deb", "-R", deb, x)  # the tree and DEBIAN/ (maintainer scripts, conffiles)
    assert (x / "DEBIAN" / "conffiles").read_text().split() == ["/etc/robustd/robustd.yaml"]
    postinst = (x / "DEBIAN" / "postinst").read_text()
    assert "/opt/robustd/make-venv.sh" in postinst and "[ -d /run/systemd/system ]" in postinst
    assert "enable robustd.service" in postinst and "start robustd.service" in postinst
    assert re.search(r"systemctl (enable|start|enable --now) robustd-slurm", postinst) is None  # disabled by default
    assert "try-restart robustd-slurm.service" in postinst  # an upgrade restarts it only where it runs
    prerm = (x / "DEBIAN" / "prerm").read_text()
    assert "stop robustd.service" in prerm and "stop robustd-slurm.service" in prerm
    postrm = (x / "DEBIAN" / "postrm").read_text()
    assert re.search(r'if \[ "\$1" = purge \]; then\n(.*\n)*?\s+rm -rf /var/lib/robustd', postrm)
    make_venv = (x / "opt" / "robustd" / "make-venv.sh").read_text()
    assert "--no-index --find-links" in make_venv
    assert filecmp_equal(x / "etc" / "robustd" / "robustd.yaml", REPO / "etc" / "robustd.yaml")
    assert forbidden_mentions(x) == []


def test_man_pages_and_completion_are_the_generated_ones(deb: Path, out: Path) -> None:
    """What `man robustctl` and a tab press read on the node are the committed man/ and completion files."""
    assert {"robustd.8", "robustctl.1", "robustd-slurm.8"} <= set(MAN_PAGES)
    x = out / "x-deb-docs"
    sh("dpkg-deb", "-x", deb, x)
    for name, path in MAN_PAGES.items():
        packaged = gzip.decompress((x / path.lstrip("/")).read_bytes())
        assert packaged == (REPO / "man" / name).read_bytes(), name
    completion = (REPO / "packaging" / "completion" / "robustctl").read_bytes()
    assert (x / BASH_COMPLETION.lstrip("/")).read_bytes() == completion
    assert (x / "usr/share/zsh/vendor-completions/_robustctl").read_bytes() == completion


def filecmp_equal(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def test_lintian_has_no_errors(deb: Path) -> None:
    have("lintian", "lintian")
    p = sh("lintian", deb, check=False)
    errors = [line for line in p.stdout.splitlines() if line.startswith("E:")]
    assert errors == [], p.stdout


def test_deb_install_run_upgrade_purge(deb: Path, out: Path) -> None:
    purge()
    t = time.monotonic()
    dpkg_install(deb)
    print(f"dpkg -i (venv from wheels): {time.monotonic() - t:.1f}s")

    # The venv is on the distribution's python3, made from the wheels, and mentions no build path.
    cfg = Path("/opt/robustd/pyvenv.cfg").read_text()
    assert "home = /usr/bin" in cfg, cfg
    assert forbidden_mentions(Path("/opt/robustd")) == []
    for f in ("/usr/bin/robustd", "/usr/bin/robustctl", "/usr/bin/robustd-slurm", "/etc/robustd/robustd.yaml",
              "/lib/systemd/system/robustd.service", "/lib/systemd/system/robustd-slurm.service"):
        assert FORBIDDEN.search(Path(f).read_bytes()) is None, f
    assert sh("/opt/robustd/bin/python", "-c", "import systemd.daemon, systemd.journal").returncode == 0
    assert sh("/opt/robustd/bin/python", "-c", "import torch", check=False).returncode != 0

    assert sh("/usr/bin/robustd", "--version").stdout.strip() == f"robustd {VERSION}"
    p = sh("/usr/bin/robustd", "--check-config")
    assert "/etc/robustd/robustd.yaml: config OK" in p.stdout
    # The installed unit is what the repository ships, and verifies against the installed binary.
    assert Path("/lib/systemd/system/robustd.service").read_bytes() == UNIT.read_bytes()
    p = sh("systemd-analyze", "verify", "/lib/systemd/system/robustd.service", check=False)
    assert (p.returncode, p.stdout + p.stderr) == (0, "")
    # robustd-slurm: the console script runs from the venv, its unit is the repository's and verifies.
    assert Path("/lib/systemd/system/robustd-slurm.service").read_bytes() == SLURM_UNIT.read_bytes()
    p = sh("systemd-analyze", "verify", "/lib/systemd/system/robustd-slurm.service", check=False)
    assert (p.returncode, p.stdout + p.stderr) == (0, "")
    assert sh("/usr/bin/robustd-slurm", "--version").stdout.strip() == f"robustd-slurm {VERSION}"
    assert "/etc/robustd/robustd.yaml: config OK" in sh("/usr/bin/robustd-slurm", "--check-config").stdout
    # The slurm.conf hooks: with robustd not running they change nothing and exit 0 (fail open); the
    # controller's with no job in their environment.
    for hook in ("healthcheck", "prolog", "epilog", "epilog-ctld", "prolog-ctld"):
        p = sh(f"/usr/lib/robustd/slurm/{hook}", check=False)
        assert p.returncode == 0, (hook, p.stderr)

    run_installed_daemon(out)

    # A local edit of the conffile survives an upgrade to a rebuilt package.
    conf = Path("/etc/robustd/robustd.yaml")
    edited = conf.read_text().replace("log_level: info", "log_level: debug") + "# edited on this host\n"
    conf.write_text(edited)
    t = time.monotonic()
    p = sh(BUILD, "deb", out / "v2", env={"ROBUSTD_VERSION": BUMPED})
    print(f"rebuild {BUMPED}: {time.monotonic() - t:.1f}s")
    deb2 = Path(p.stdout.strip().splitlines()[-1])
    assert deb2.name == f"robustd_{BUMPED}-1_amd64.deb"
    dpkg_install(deb2)
    assert sh("dpkg-query", "-W", "-f", "${Version}", "robustd").stdout == f"{BUMPED}-1"
    assert sh("/usr/bin/robustd", "--version").stdout.strip() == f"robustd {BUMPED}"
    assert conf.read_text() == edited
    assert "config OK" in sh("/usr/bin/robustd", "--check-config").stdout

    # remove: the app and its venv go, the config and the state stay; purge: nothing is left.
    state = Path("/var/lib/robustd")
    state.mkdir(exist_ok=True)
    (state / "events.db").write_text("state")
    sh("dpkg", "-r", "robustd")
    assert not Path("/opt/robustd").exists() and not Path("/usr/bin/robustd").exists()
    assert conf.read_text() == edited and (state / "events.db").exists()
    sh("dpkg", "--purge", "robustd")
    left = [p for p in LEFTOVERS if os.path.lexists(p)]
    assert left == []
    assert sh("dpkg", "-s", "robustd", check=False).returncode != 0


def run_installed_daemon(out: Path) -> None:
    """The installed robustd, started by hand (systemd is not PID 1 here), queried by robustctl."""
    d = out / "daemon"
    d.mkdir()
    config = yaml.safe_load(Path("/etc/robustd/robustd.yaml").read_text())
    sock = d / "robustd.sock"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM")}
    log = (d / "log").open("w")
    proc = subprocess.Popen(["/usr/bin/robustd", "--config", "/etc/robustd/robustd.yaml", "--socket", str(sock),
                             "--state-dir", str(d / "state")], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None, (d / "log").read_text()
            assert time.monotonic() < deadline, "no socket after 30 s:\n" + (d / "log").read_text()
            time.sleep(0.2)
        p = sh("/usr/bin/robustctl", "--socket", sock, "status", check=False)
        assert p.returncode in (0, 1, 2), p.stdout + p.stderr  # OK / WARNING / CRITICAL verdicts
        assert p.stdout.startswith("node "), p.stdout
        p = sh("/usr/bin/robustctl", "--socket", sock, "--json", "status", check=False)
        assert p.returncode in (0, 1, 2) and '"severity"' in p.stdout.lower(), p.stdout
        assert f"robustd {VERSION} ready" in (d / "log").read_text()
        assert config["state_dir"] == "/var/lib/robustd"  # the packaged default, overridden above
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=25)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def rpm(out: Path) -> Path:
    path = make_package("rpm", out / "rpm")
    assert path.name == f"robustd-{VERSION}-1.x86_64.rpm"
    return path


def test_rpm_contents_and_scriptlets(rpm: Path) -> None:
    files = set(sh("rpm", "-qpl", rpm).stdout.split())
    assert files >= RPM_FILES, RPM_FILES - files
    assert f"/opt/robustd/wheels/robustd-{VERSION}-py3-none-any.whl" in files
    assert not any(f.startswith(("/var/", "/run/", "/opt/robustd/bin", "/opt/robustd/lib/")) for f in files)
    assert sh("rpm", "-qp", "--configfiles", rpm).stdout.split() == ["/etc/robustd/robustd.yaml"]
    assert sh("rpm", "-qp", "--qf", "%{VERSION}-%{RELEASE}", rpm).stdout == f"{VERSION}-1"
    requires = sh("rpm", "-qpR", rpm).stdout
    assert "python(abi) = 3.11" in requires and "python(abi) = 3.12" in requires

    scripts = sh("rpm", "-qp", "--scripts", rpm).stdout
    scriptlet = r"^(\w+) scriptlet \(using /bin/sh\):\n(.*?)(?=^\w+ scriptlet|\Z)"
    sections = dict(re.findall(scriptlet, scripts, re.M | re.S))
    assert set(sections) == {"postinstall", "preuninstall", "postuninstall"}, scripts
    assert "/opt/robustd/make-venv.sh" in sections["postinstall"]
    assert "enable --now robustd.service" in sections["postinstall"]
    assert "robustd-slurm" not in sections["postinstall"]  # disabled by default
    assert "[ $1 -eq 0 ]" in sections["preuninstall"] and "disable --now robustd.service" in sections["preuninstall"]
    assert "disable --now robustd-slurm.service" in sections["preuninstall"]
    assert "try-restart robustd.service" in sections["postuninstall"]
    assert "try-restart robustd-slurm.service" in sections["postuninstall"]
    assert "rm -rf /opt/robustd" in sections["postuninstall"]
    assert "/var/lib/robustd" not in sections["postuninstall"].split("rm -rf /opt/robustd")[1]


def test_rpm_installs_into_a_temporary_root(rpm: Path, out: Path) -> None:
    root = out / "rpmroot"
    root.mkdir()
    sh("rpm", "-i", f"--root={root}", "--nodeps", "--noscripts", rpm)
    for f in RPM_FILES:
        assert (root / f.lstrip("/")).is_file(), f
    assert (root / "usr/lib/systemd/system/robustd.service").read_bytes() == UNIT.read_bytes()
    assert (root / "usr/lib/systemd/system/robustd-slurm.service").read_bytes() == SLURM_UNIT.read_bytes()
    assert os.access(root / "usr/bin/robustd", os.X_OK)
    assert (root / "opt/robustd/wheels/VERSION").read_text().strip() == VERSION
    assert forbidden_mentions(root / "opt") == [] and forbidden_mentions(root / "usr") == []
    assert sh("rpm", f"--root={root}", "-q", "robustd").stdout.strip() == f"robustd-{VERSION}-1.x86_64"


def unit_copy(tmp: Path, unit: Path = UNIT) -> Path:
    """The repository's unit with its /usr/bin/robustd* commands pointed at a binary that exists."""
    u = tmp / unit.name
    u.write_text(re.sub(r"/usr/bin/robustd(-slurm)?", "/bin/true", unit.read_text()))
    return u


@pytest.mark.parametrize("unit", [UNIT, SLURM_UNIT], ids=lambda u: u.name)
def test_unit_verifies_clean(tmp_path: Path, unit: Path) -> None:
    have("systemd-analyze", "systemd")
    p = sh("systemd-analyze", "verify", unit_copy(tmp_path, unit), check=False)
    assert (p.returncode, p.stdout + p.stderr) == (0, "")


def test_slurm_unit(tmp_path: Path) -> None:
    """robustd-slurm: a notify service on robustd's config, after robustd, root without capabilities."""
    text = SLURM_UNIT.read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    for key, value in {"Type": "notify", "Restart": "on-failure", "StateDirectory": "robustd",
                       "ExecStart": "/usr/bin/robustd-slurm --config /etc/robustd/robustd.yaml",
                       "ProtectSystem": "strict", "NoNewPrivileges": "yes", "CapabilityBoundingSet": ""}.items():
        assert settings.get(key) == value, key
    assert "robustd.service" in settings["After"] and "robustd.service" in settings["Wants"]
    assert "User" not in settings  # scontrol update needs SlurmUser or root (README "Slurm")
    have("systemd-analyze", "systemd")
    p = sh("systemd-analyze", "security", "--offline=true", unit_copy(tmp_path, SLURM_UNIT), check=False)
    m = re.search(r"Overall exposure level for robustd-slurm\.service: ([\d.]+)", p.stdout + p.stderr)
    assert m is not None, p.stderr[-300:]
    print(f"systemd-analyze security exposure (robustd-slurm): {m.group(1)}")
    assert float(m.group(1)) <= 3.0


def test_unit_hardening(tmp_path: Path) -> None:
    text = UNIT.read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    for key, value in {"Type": "notify", "Restart": "on-failure", "ExecReload": "/bin/kill -HUP $MAINPID",
                       "RuntimeDirectory": "robustd", "StateDirectory": "robustd", "ConfigurationDirectory": "robustd",
                       "ProtectSystem": "strict", "ProtectHome": "read-only", "PrivateTmp": "yes",
                       "NoNewPrivileges": "yes"}.items():
        assert settings.get(key) == value, key
    assert "WatchdogSec" in settings
    assert int(settings["LimitNOFILE"]) >= 4096  # the Unix socket relay's connections (3 descriptors each)
    assert set(settings["CapabilityBoundingSet"].split()) == {"CAP_SYSLOG", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}
    for cap in ("CAP_SYSLOG", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_NET_ADMIN"):
        assert re.search(rf"^# .*{cap}", text, re.M), f"no comment justifying {cap}"
    assert "ProtectKernelLogs" not in settings and "PrivateDevices" not in settings  # /dev/kmsg, GPUs
    have("systemd-analyze", "systemd")
    p = sh("systemd-analyze", "security", "--offline=true", unit_copy(tmp_path), check=False)
    m = re.search(r"Overall exposure level for robustd\.service: ([\d.]+)", p.stdout + p.stderr)
    assert m is not None, "systemd-analyze security --offline=true gave no score: " + p.stderr[-300:]
    print(f"systemd-analyze security exposure: {m.group(1)}")
    assert float(m.group(1)) <= 5.0


def test_rpm_scriptlets_install_upgrade_erase(rpm: Path, out: Path) -> None:
    """The rpm's %post/%postun for real on this host, with a private rpm database (dpkg's robustd purged)."""
    purge()
    db = out / "rpmdb"
    db.mkdir()
    sh("rpm", "--initdb", "--dbpath", db)
    conf = Path("/etc/robustd/robustd.yaml")
    try:
        sh("rpm", "-i", "--nodeps", "--dbpath", db, rpm)
        assert sh("/usr/bin/robustd", "--version").stdout.strip() == f"robustd {VERSION}"
        assert "home = /usr/bin" in Path("/opt/robustd/pyvenv.cfg").read_text()
        assert forbidden_mentions(Path("/opt/robustd")) == []
        edited = conf.read_text() + "# edited on this host\n"
        conf.write_text(edited)
        p = sh(BUILD, "rpm", out / "rpm2", env={"ROBUSTD_VERSION": BUMPED})
        sh("rpm", "-U", "--nodeps", "--dbpath", db, Path(p.stdout.strip().splitlines()[-1]))
        assert sh("/usr/bin/robustd", "--version").stdout.strip() == f"robustd {BUMPED}"
        assert conf.read_text() == edited  # %config(noreplace)
        sh("rpm", "-e", "--dbpath", db, "robustd")
        assert not os.path.lexists("/opt/robustd") and not os.path.lexists("/usr/bin/robustd")
        assert not conf.exists() and Path("/etc/robustd/robustd.yaml.rpmsave").read_text() == edited
    finally:
        if sh("rpm", "-q", "--dbpath", db, "robustd", check=False).returncode == 0:
            sh("rpm", "-e", "--dbpath", db, "robustd", check=False)
        shutil.rmtree("/etc/robustd", ignore_errors=True)
        shutil.rmtree("/opt/robustd", ignore_errors=True)

"""Rules the code keeps, checked mechanically."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE = [p for d in ("robustd", "checks", "stoptests") for p in (REPO / d).rglob("*.py") if "_pb2" not in p.name]


def _string_literals(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_outside_paths_are_spelled_only_in_roots() -> None:
    """One root for every outside path: tests must be able to point each one at a fixture."""
    bad = []
    for path in CODE:
        if path.name == "roots.py":
            continue
        for line, text in _string_literals(ast.parse(path.read_text())):
            if any(text.startswith(p) for p in ("/proc", "/sys", "/dev")):
                bad.append(f"{path.relative_to(REPO)}:{line}: {text!r}")
    assert not bad, "literal host paths outside robustd/roots.py:\n" + "\n".join(bad)


def test_daemon_never_imports_torch() -> None:
    """Only the stop-time children (stoptests/, run as separate processes) may import torch."""
    bad = []
    for path in CODE:
        if path.parent == REPO / "stoptests":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n.split(".")[0] == "torch"]
    assert not bad, bad


def test_the_running_daemon_loads_no_torch_no_recorder_and_no_kubernetes() -> None:
    """What the daemon process really imports, with every built-in check loaded as it loads them."""
    code = ("import sys\nimport robustd.daemon\nfrom robustd.checkset import discover_checks\ndiscover_checks()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kubernetes', 'matplotlib')"
            " or m.startswith('robustd.stragglers')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_check_is_one_folder_of_one_shape_and_nothing_else_is_under_checks() -> None:
    """checks/<name>/ for each built-in check: __init__.py exporting its class from check.py, its Config in
    config.py, its rule file rules.yaml; beside them only checks/common/ (no stop-time child: stoptests/)."""
    from checks import BUILTIN
    from checks.kernel.rules import SHIPPED_RULES

    folders = {p.name for p in (REPO / "checks").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {c.name for c in BUILTIN} | {"common"}
    for cls in BUILTIN:
        files = {p.name for p in (REPO / "checks" / cls.name).iterdir()}
        assert {"__init__.py", "check.py", "config.py", "rules.yaml"} <= files, (cls.name, files)
        assert cls.__module__ == f"checks.{cls.name}.check" and cls.Config.__module__ == f"checks.{cls.name}.config"
        assert getattr(importlib.import_module(f"checks.{cls.name}"), cls.__name__) is cls
        assert Path(cls.rules or SHIPPED_RULES) == REPO / "checks" / cls.name / "rules.yaml"


def test_a_checks_config_and_parsers_import_without_any_driver_library() -> None:
    """`checks`, and a check's config.py and parse.py, need neither pynvml nor pyroute2 (only its check.py may)."""
    code = ("import sys\nimport checks\n"
            + "".join(f"import checks.{c}.config\n" for c in ("kernel", "nic", "gpu", "pcie", "thermal", "host"))
            + "import checks.gpu.parse, checks.nic.parse, checks.common.thresholds\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pynvml', 'pyroute2')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

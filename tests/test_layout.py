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


# The layers of the README's "Layout", bottom first. A module may import modules of its own group and of any
# group on a lower level, never a group beside it or above it. Groups are module-name prefixes (`=name`: that
# module alone); every module of the tree must fall in one (a new module is placed on purpose).
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"vocabulary": ("=robustd", "robustd.model", "robustd.durations", "robustd.flags", "robustd.paths",
                    "robustd.roots", "robustd.yamlpos", "robustd.bounds", "robustd.atomicfile", "robustd.identity",
                    "robustd.inventory",
                    "robustd.traffic", "robustd.cpuinfo", "robustd.sdnotify", "robustd.socketpath", "robustd.ratelog",
                    "robustd.relay", "robustd.startup", "robustd.tls", "robustd.api.v1", "robustd.nvmlemu",
                    "robustd.stragglers", "robustd.fleet",
                    # the command-line pieces every console script shares: --help examples, and the exit codes
                    # (stdlib only) that fleet diagnose's and stragglers watch's judging return
                    "robustd.cli.args", "robustd.cli.exitcodes")},
    {"contracts": ("robustd.codes", "robustd.check", "robustd.config", "robustd.sections", "robustd.triage")},
    # made (a finding), judged (a condition), stored (an event): three pieces that know nothing of each other
    {"made": ("checks",), "judged": ("robustd.policy", "robustd.boots"),
     "stored": ("robustd.store", "robustd.writer", "robustd.reads", "robustd.journal")},
    {"core": ("robustd.hub", "robustd.engine", "robustd.runner", "robustd.checkset", "robustd.owned",
              "robustd.diagnostics", "robustd.tracer", "robustd.reload", "robustd.authz", "robustd.evidence")},
    {"served": ("robustd.api", "robustd.metrics", "robustd.metrics_http", "robustd.server", "robustd.daemon")},
    # what a client of the API is made of: the adapters' common base, robustctl's views and verbs
    # (robustd.fleet.diagnose: the job-level diagnosis dials the daemons as robustctl does; the rest of
    # robustd.fleet, its plain types and judging included, stays vocabulary)
    {"clients' base": ("robustd.adapters.common", "robustd.adapters", "robustd.cli", "robustd.fleet.diagnose")},
    # each adapter on the common base, never on another adapter
    {"slurm": ("robustd.adapters.slurm",), "k8s": ("robustd.adapters.k8s",)},
    # robustctl itself: every verb, the Slurm hooks among them (`robustctl slurm`)
    {"robustctl": ("robustd.cli.robustctl", "robustd.cli.slurm")},
]
STOP_TIME_CHILDREN = ("stoptests",)  # child processes: the stdlib, torch and their own package only


def _module_graph() -> dict[str, set[str]]:
    """Every module of robustd/, checks/ and stoptests/ and the tree's modules it imports (at any depth of the
    file: a late import is an import too); `from pkg import name` counts as importing pkg.name when that is a
    module."""
    files = {}
    for top in ("robustd", "checks", *STOP_TIME_CHILDREN):
        for p in (REPO / top).rglob("*.py"):
            if "_pb2" in p.name:
                continue
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = p

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (resolve(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    target = resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in files else resolve(base)
                    if target:
                        deps.add(target)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def _place(mod: str) -> tuple[int, str] | None:
    """(level, group) of a module: the group with the longest prefix that covers it."""
    best: tuple[int, int, str] | None = None
    for level, groups in enumerate(LAYERS):
        for group, prefixes in groups.items():
            for prefix in prefixes:
                exact = prefix.startswith("=")
                name = prefix.removeprefix("=")
                covers = mod == name or (not exact and mod.startswith(name + "."))
                if covers and (best is None or len(name) > best[0]):
                    best = (len(name), level, group)
    return None if best is None else (best[1], best[2])


def test_imports_go_down_the_layers_only() -> None:
    graph = _module_graph()
    unplaced = sorted(m for m in graph if _place(m) is None and not m.startswith(STOP_TIME_CHILDREN))
    assert not unplaced, f"modules in no layer of tests/test_layout.py (place them): {unplaced}"
    bad = []
    for mod, deps in sorted(graph.items()):
        if mod.startswith(STOP_TIME_CHILDREN):
            bad += [f"{mod} -> {d} (a stop-time child imports only its own package)" for d in sorted(deps)
                    if not d.startswith(STOP_TIME_CHILDREN)]
            continue
        here = _place(mod)
        assert here is not None
        for dep in sorted(deps):
            there = _place(dep)
            if there is None or there == here or there[0] < here[0]:
                continue
            side = "beside" if there[0] == here[0] else "above"
            bad.append(f"{mod} ({here[1]}) -> {dep} ({there[1]}, {side} it)")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_circle_of_imports() -> None:
    graph = _module_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_named_boundaries_hold() -> None:
    """The boundaries issue 25 named, spelt out so a message says which one broke."""
    graph = _module_graph()
    rules = [("robustd.config", ("robustd.adapters", "robustd.diagnostics")),
             ("robustd.policy", ("robustd.store",)),
             ("robustd.adapters.k8s", ("robustd.adapters.slurm",)),
             ("robustd.adapters.slurm", ("robustd.adapters.k8s",))]
    bad = [f"{mod} -> {dep}" for mod, deps in graph.items() for prefix, banned in rules
           if mod == prefix or mod.startswith(prefix + ".") for dep in deps if dep.startswith(banned)]
    assert not bad, bad


def test_every_check_is_one_folder_of_one_shape_and_nothing_else_is_under_checks() -> None:
    """checks/<name>/ for each built-in check: __init__.py exporting its class from check.py, its Config in
    config.py, its rule file rules.yaml; beside them only checks/common/ and checks/rules/ (the inventory of what
    drivers print, which the kernel rules are tested against; no stop-time child: stoptests/)."""
    from checks import BUILTIN
    from checks.kernel.rules import SHIPPED_RULES

    # (a folder holding only byte code is what a checkout leaves behind when a package moves: not a folder)
    folders = {p.name for p in (REPO / "checks").iterdir()
               if p.is_dir() and p.name != "__pycache__" and any(c.name != "__pycache__" for c in p.iterdir())}
    assert folders == {c.name for c in BUILTIN} | {"common", "rules"}
    for cls in BUILTIN:
        files = {p.name for p in (REPO / "checks" / cls.name).iterdir()}
        assert {"__init__.py", "check.py", "config.py", "rules.yaml"} <= files, (cls.name, files)
        assert cls.__module__ == f"checks.{cls.name}.check" and cls.Config.__module__ == f"checks.{cls.name}.config"
        assert getattr(importlib.import_module(f"checks.{cls.name}"), cls.__name__) is cls
        assert Path(cls.rule_file or SHIPPED_RULES) == REPO / "checks" / cls.name / "rules.yaml"


def test_a_checks_config_and_parsers_import_without_any_driver_library() -> None:
    """`checks`, and a check's config.py and parse.py, need none of pynvml, pyroute2, jeepney (only check.py may)."""
    code = ("import sys\nimport checks\n"
            + "".join(f"import checks.{c}.config\n"
                      for c in ("kernel", "nic", "gpu", "pcie", "thermal", "host", "services"))
            + "import checks.gpu.parse, checks.nic.parse, checks.common.thresholds\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pynvml', 'pyroute2', 'jeepney')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

#!/usr/bin/env python3
"""Generate man/ (a page per console script) and packaging/completion/ from the argument parsers.

    scripts/gen-man.py            write what changed (`make man`)
    scripts/gen-man.py --check    exit 1 naming each stale or missing file, write nothing (the tests)

Every console script in pyproject.toml gets a page: robustctl in section 1, the daemon and the
scheduler agents in section 8. The parser is the one the program really uses: the script's entry
point is called and its first ArgumentParser.parse_args is intercepted, so a new agent or option
needs no change here. A script whose module does not exist yet is reported and skipped.
argparse-manpage (pinned in requirements-dev.txt) writes the roff; the sections argparse has no
place for (examples of the daemons, files, environment, see also) are added from EXTRA below.

The committed files are like the generated protobuf code: regenerate them with `make man` when a
parser changes. A page keeps its date until its text changes, so regenerating is a no-op when
nothing changed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MAN_DIR = REPO / "man"
COMPLETION_DIR = REPO / "packaging" / "completion"
COMPLETED = ("robustctl",)  # scripts with shell completion (the others are services, not typed by hand)
SEE_ALSO = "robustd(8), robustctl(1), robustd-slurm(8), robustd-k8s(8), systemctl(1), journalctl(1)"

EXTRA: dict[str, dict[str, str]] = {
    "robustd": {
        "files": ".TP\n/etc/robustd/robustd.yaml\nthe configuration (every key documented in it)\n"
                 ".TP\n/run/robustd/robustd.sock\nthe gRPC socket robustctl and the agents use\n"
                 ".TP\n/var/lib/robustd\nthe event log (SQLite) and state\n"
                 ".TP\n/usr/share/robustd/proto\nthe API's protobuf definitions",
        "signals": ".TP\nSIGHUP\nre\\-read the config; a bad one is rejected and the running one stays\n"
                   ".TP\nSIGTERM, SIGINT\nstop within seconds (a second signal exits at once)",
    },
    "robustctl": {
        "exit status": "",  # robustd/cli/exitcodes.py's table, filled in by page()
        "files": ".TP\n/run/robustd/robustd.sock\n"
                 "the daemon's socket unless \\-\\-socket or ROBUSTD_SOCKET says otherwise",
    },
}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def console_scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def parser_of(entry: str) -> argparse.ArgumentParser | None:
    """The parser `module:function` parses its command line with; None when the module does not exist yet."""
    module_name, _, func_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            return None
        raise
    build = getattr(module, "build_parser", None)
    if callable(build):
        return build()

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    func = getattr(module, func_name)
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            func(["--help"]) if inspect.signature(func).parameters else func()
        except _Captured as c:
            return c.parser
    raise RuntimeError(f"{entry} returned without parsing its command line")


def section(name: str) -> int:
    return 1 if name == "robustctl" else 8


def page(name: str, parser: argparse.ArgumentParser, date: str) -> str:
    from argparse_manpage.manpage import Manpage

    parser.prog = name
    # A top-level `examples:` epilog (robustd, the agents) becomes the EXAMPLES section, not a COMMENTS one.
    own = _example_lines(parser.epilog)
    if own:
        parser.epilog = None
    data = {"project_name": "robustd", "manual_section": section(name), "date": date,
            "manual_title": "robustd manual", "description": (parser.description or "").rstrip(".")}
    man = Manpage(parser, _data=data, format="pretty")
    extra = dict(EXTRA.get(name, {}))
    if "exit status" in extra:
        from robustd.cli import exitcodes

        extra["exit status"] = exitcodes.roff()
    verb_examples = list(dict.fromkeys(own + examples_of(parser)))  # a verb and its sub-verb may share one
    if verb_examples:
        extra.setdefault("examples", ".nf\n" + "\n".join(_roff(line) for line in verb_examples) + "\n.fi")
    extra.setdefault("see also", ", ".join(p for p in SEE_ALSO.split(", ") if not p.startswith(f"{name}(")))
    for heading, content in extra.items():
        man.add_section(heading, "=", content)
    return _fit(str(man))


_TH = re.compile(r"^(\.TH .*)$", re.M)
_LONG_WORD = re.compile(r"[^\s]{40,}")


def _fit(text: str) -> str:
    """A page that formats without troff warnings at any width (`man -l` prints none at MANWIDTH=80).

    Filled text is left-aligned (`.ad l`): a justified line holding one long option list or choice list
    cannot be stretched, and troff says `cannot adjust line` for each. Such long words also get break
    points (`\\:`, which prints nothing) after their commas and bars, so they wrap instead of running off.
    """
    text = _TH.sub(r"\1\n.ad l", text, count=1)
    return _LONG_WORD.sub(lambda m: re.sub(r"(?<!\\)([,|])(?!\\:)", r"\1\\:", m.group()), text)


def examples_of(parser: argparse.ArgumentParser) -> list[str]:
    """The example command lines of every sub-command's `--help` epilog, in parser order."""
    out: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                out += _example_lines(sub.epilog) + examples_of(sub)
    return out


def _example_lines(epilog: str | None) -> list[str]:
    """The command lines of an `example:`/`examples:` epilog (robustd/cli/args.py `examples`)."""
    if not epilog or not epilog.startswith("example"):
        return []
    return [line.strip() for line in epilog.splitlines()[1:] if line.startswith("  ")]


def _roff(line: str) -> str:
    text = line.replace("\\", "\\\\").replace("-", "\\-")
    return "\\&" + text if text.startswith((".", "'")) else text


_DATE = re.compile(r'^(\.TH \S+ "\d+" )"[^"]*"', re.M)


def body(text: str) -> str:
    """A page without its date: what decides whether it is stale."""
    return _DATE.sub(r'\1""', text, count=1)


def today() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC) if epoch else datetime.datetime.now(datetime.UTC)
    return when.strftime("%Y-%m-%d")


def completion(name: str) -> str:
    import argcomplete

    return argcomplete.shellcode([name], shell="bash")


def expected(root: Path = REPO) -> dict[Path, str]:
    """Every generated file under `root` and its text (pages dated like the ones there when their text is the same)."""
    out: dict[Path, str] = {}
    for name, entry in sorted(console_scripts().items()):
        parser = parser_of(entry)
        if parser is None:
            print(f"gen-man: {name}: {entry.partition(':')[0]} does not exist yet; no page", file=sys.stderr)
            continue
        path = root / MAN_DIR.relative_to(REPO) / f"{name}.{section(name)}"
        text = page(name, parser, today())
        if path.exists():
            old = path.read_text()
            if body(old) == body(text):
                text = old
        out[path] = text
    for name in COMPLETED:
        out[root / COMPLETION_DIR.relative_to(REPO) / name] = completion(name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate man/ and packaging/completion/ from the parsers.")
    p.add_argument("--check", action="store_true", help="report stale or missing files, write nothing")
    p.add_argument("--root", type=Path, default=REPO, help="the tree holding man/ and packaging/completion/")
    args = p.parse_args(argv)
    root = args.root.resolve()
    man_dir = root / MAN_DIR.relative_to(REPO)
    os.environ["COLUMNS"] = "80"  # the parsers' help text must not depend on the terminal
    files = expected(root)
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    extra = [path for path in man_dir.glob("*.[18]") if path not in files] if man_dir.exists() else []
    if args.check:
        for path in stale:
            print(f"{path.relative_to(root)}: stale or missing; run `make man`")
        for path in extra:
            print(f"{path.relative_to(root)}: no console script makes this page; run `make man`")
        return 1 if stale or extra else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path])
        print(f"wrote {path.relative_to(root)}")
    for path in extra:
        path.unlink()
        print(f"removed {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

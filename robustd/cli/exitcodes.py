"""robustctl's exit codes: every verb's, in one place, so each code means one thing within a verb.

Scripts branch on them, so they are a contract. Three mean the same for every verb that asks a daemon
(3 unreachable, 4 any other RPC error) and two for every verb (64 usage error, 130 Ctrl-C); the rest
are the verb's own outcomes, never one of those. `--help` of each verb, the man page's EXIT STATUS
(scripts/gen-man.py) and the README's table are all made from `VERBS`; tests/test_cli_exit_codes.py
checks that they agree and that the verbs return these codes.
"""

from __future__ import annotations

import argparse

OK = 0
UNREACHABLE = 3  # the daemon (or, for fleet verbs, every host that mattered) could not be reached
RPC = 4  # any other RPC error: the daemon's status code and details are printed
USAGE = 64  # sysexits EX_USAGE; argparse's own 2 would read as CRITICAL
CANTCREAT = 73  # sysexits EX_CANTCREAT: an output file cannot be written (evidence export)
CONFIG = 78  # sysexits EX_CONFIG: the config file cannot be used (slurm status)
INTERRUPTED = 130  # 128 + SIGINT
TERMINATED = 143  # 128 + SIGTERM

# status (and fleet status): the node's severity
WARNING = 1
CRITICAL = 2

# diag run / show / cancel: the report's outcome, then the daemon refusing to start one
DIAG_FAIL_WARNING = 1
DIAG_FAIL_CRITICAL = 2
DIAG_ERROR = 5  # the diagnostic itself could not run properly: no verdict on the hardware
DIAG_CANCELLED = 6
DIAG_BUSY = 7  # gRPC ABORTED: another diagnostic is running
DIAG_REFUSED = 8  # gRPC FAILED_PRECONDITION: GPU compute processes alive (no --force), state disk not answering
DIAG_RUNNING = 9  # show: the report is not finished yet

# local verbs that read files
SIM_FILE = 1  # the state file cannot be read or written
UNREADABLE = 2  # triage: a log; stragglers: a trace, its metadata or the trace directory
MISSING_PACKAGE = 5  # stragglers: numpy/pyarrow/matplotlib are not installed
ALERT = 1  # stragglers watch

# fleet
SUSPECTS = 1  # fleet stacks / diagnose: a host, group or link is named
INCOMPLETE = 4  # fleet diagnose: a test or a collective could not run where it had to (RPC errors included)

# slurm hooks (robustd/adapters/slurm/hooks.py and ctld_hook.py spell the same values)
SLURM_REFUSE = 1  # prolog: the node was drained, Slurm requeues the job; prolog-ctld: a suspect was drained
SLURM_WARNING = 1  # status: SLURM_DRAIN_SUPPRESSED or flapping stands

_DAEMON = ((UNREACHABLE, "robustd unreachable"), (RPC, "other RPC error"))
_USAGE = ((USAGE, "usage error"),)
_DONE = ((OK, "done"),)

# Verb (as typed after `robustctl`) -> its exit codes and what each means, in order.
VERBS: dict[str, tuple[tuple[int, str], ...]] = {
    "status": ((OK, "OK"), (WARNING, "WARNING"), (CRITICAL, "CRITICAL"), *_DAEMON, *_USAGE),
    "watch": ((OK, "ended by Ctrl-C, SIGTERM or its reader leaving"), *_DAEMON[:1],
              (RPC, "other RPC error (also: cannot resume after --from-seq)"), *_USAGE),
    "events": (*_DONE, *_DAEMON, *_USAGE),
    "checks": (*_DONE, *_DAEMON, *_USAGE),
    "ack": ((OK, "acknowledged"), *_DAEMON[:1], (RPC, "other RPC error (NOT_FOUND: no such condition)"), *_USAGE),
    "sim": (*_DONE, (SIM_FILE, "the state file cannot be read or written"), (USAGE, "usage error or bad value")),
    "diag run": ((OK, "PASS"), (DIAG_FAIL_WARNING, "FAIL of WARNING severity"),
                 (DIAG_FAIL_CRITICAL, "FAIL of CRITICAL severity"), *_DAEMON,
                 (DIAG_ERROR, "ERROR: the diagnostic could not run properly"), (DIAG_CANCELLED, "CANCELLED"),
                 (DIAG_BUSY, "another diagnostic is running"),
                 (DIAG_REFUSED, "refused: GPU compute processes alive (see --force) or the state disk"),
                 (USAGE, "usage error, or a level, test or GPU the daemon does not know")),
    "diag show": ((OK, "PASS"), (DIAG_FAIL_WARNING, "FAIL of WARNING severity"),
                  (DIAG_FAIL_CRITICAL, "FAIL of CRITICAL severity"), *_DAEMON[:1],
                  (RPC, "other RPC error (NOT_FOUND: no such report)"),
                  (DIAG_ERROR, "ERROR: the diagnostic could not run properly"), (DIAG_CANCELLED, "CANCELLED"),
                  (DIAG_RUNNING, "still running"), *_USAGE),
    "diag cancel": ((OK, "PASS (it had finished)"), (DIAG_FAIL_WARNING, "FAIL of WARNING severity"),
                    (DIAG_FAIL_CRITICAL, "FAIL of CRITICAL severity"), *_DAEMON[:1],
                    (RPC, "other RPC error (NOT_FOUND: no such report)"),
                    (DIAG_ERROR, "ERROR"), (DIAG_CANCELLED, "CANCELLED"), *_USAGE),
    "diag list": (*_DONE, *_DAEMON, *_USAGE),
    "diag golden record": ((OK, "recorded"), *_DAEMON[:1],
                           (RPC, "other RPC error (FAILED_PRECONDITION: no passing MiniGPT report)"), *_USAGE),
    "diag golden show": (*_DONE, *_DAEMON, *_USAGE),
    "fleet status": ((OK, "every host OK"), (WARNING, "a host WARNING, none CRITICAL, all answered"),
                     (CRITICAL, "a host CRITICAL"), (UNREACHABLE, "a host unreachable or erroring, none CRITICAL"),
                     (USAGE, "usage error, or a hosts file that cannot be read")),
    "fleet stacks": ((OK, "no outlier"), (SUSPECTS, "suspects named"), (UNREACHABLE, "no host answered"),
                     (USAGE, "usage error, or a hosts file that cannot be read")),
    "fleet diagnose": ((OK, "PASS"), (SUSPECTS, "suspects named (a host or a link)"),
                       (UNREACHABLE, "no suspect, but hosts that did not answer"),
                       (INCOMPLETE, "the diagnosis could not run in full"), *_USAGE,
                       (INTERRUPTED, "Ctrl-C: every run it started cancelled"),
                       (TERMINATED, "SIGTERM: every run it started cancelled")),
    "fleet replay-plan": (*_DONE, (USAGE, "usage error or a layout that does not divide")),
    "fleet replay-locate": (*_DONE, (USAGE, "usage error or a layout that does not divide")),
    "fleet standby": (*_DONE, *_USAGE),
    "stragglers analyze": ((OK, "analysed"), (UNREADABLE, "a trace, its metadata or the directory cannot be read"),
                           (MISSING_PACKAGE, "numpy, pyarrow or matplotlib is not installed"),
                           (USAGE, "usage error or a malformed trace")),
    "stragglers watch": ((OK, "ended without an alert"), (ALERT, "ALERT: S stayed above --alert-slowdown"),
                         (UNREADABLE, "the directory or its metadata cannot be read (--once)"),
                         (MISSING_PACKAGE, "numpy, pyarrow or matplotlib is not installed"),
                         (USAGE, "usage error or a malformed trace")),
    "evidence list": (*_DONE, *_DAEMON, *_USAGE),
    "evidence show": (*_DONE, *_DAEMON[:1], (RPC, "other RPC error (NOT_FOUND: no such bundle)"), *_USAGE),
    "evidence export": ((OK, "written"), *_DAEMON[:1], (RPC, "other RPC error (NOT_FOUND: no such bundle)"),
                        (CANTCREAT, "FILE cannot be written"), *_USAGE),
    "evidence create": ((OK, "made"), *_DAEMON[:1],
                        (RPC, "other RPC error (RESOURCE_EXHAUSTED: too many for an unprivileged caller)"), *_USAGE),
    "trace": ((OK, "every selected process captured"), (1, "some process not captured (each says why)"),
              *_DAEMON, *_USAGE),
    "triage": ((OK, "an answer"), (UNREADABLE, "a log cannot be read"), *_USAGE),
    "slurm healthcheck": ((OK, "always (the hook fails open)"), *_USAGE),
    "slurm prolog": ((OK, "the node may run the job"), (SLURM_REFUSE, "drained: Slurm requeues the job"), *_USAGE),
    "slurm epilog": ((OK, "always (the hook fails open)"), *_USAGE),
    "slurm epilog-ctld": ((OK, "always (the hook fails open)"), *_USAGE),
    "slurm prolog-ctld": ((OK, "no suspect drained"), (SLURM_REFUSE, "a suspect drained: Slurm requeues the job"),
                          *_USAGE),
    "slurm status": ((OK, "nothing stands"), (SLURM_WARNING, "a warning stands (SLURM_DRAIN_SUPPRESSED or flapping)"),
                     (CONFIG, "the config cannot be used (named on stderr)"), *_USAGE),
}

COMMON = ("every verb: 64 usage error, 130 interrupted (Ctrl-C; watch ends 0); a verb that asks a daemon: "
          "3 robustd unreachable, 4 other RPC error; each verb's --help lists its own")


def summary(verb: str) -> str:
    """`0 OK; 1 WARNING; ...`: one verb's codes on one line (the README's table cells)."""
    return "; ".join(f"{code} {meaning}" for code, meaning in VERBS[verb])


def epilog(verb: str) -> str:
    """The `exit status:` block a verb's --help ends with."""
    return "exit status:" + "".join(f"\n  {code:<3}  {meaning}" for code, meaning in VERBS[verb])


def markdown() -> str:
    """The README's exit-code table, exactly (a test compares the README with it)."""
    rows = ["| Verb | Exit status |", "| --- | --- |"]
    rows += [f"| `{verb}` | {summary(verb)} |" for verb in VERBS]
    return "\n".join(rows)


def roff() -> str:
    """The man page's EXIT STATUS section: one tagged paragraph per verb."""
    def esc(text: str) -> str:
        return text.replace("\\", "\\\\").replace("-", "\\-")

    out = [esc(COMMON[0].upper() + COMMON[1:]) + "."]
    out += [f".TP\n\\fB{esc(verb)}\\fR\n{esc(summary(verb))}" for verb in VERBS]
    return "\n".join(out)


def annotate(parser: argparse.ArgumentParser, path: str = "") -> None:
    """End the --help of every verb in `VERBS` (under robustctl's `parser`) with its `exit status:` block."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                verb = f"{path} {name}".strip()
                if verb in VERBS:
                    sub.epilog = (sub.epilog + "\n\n" if sub.epilog else "") + epilog(verb)
                annotate(sub, verb)

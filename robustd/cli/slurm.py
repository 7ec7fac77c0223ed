"""`robustctl slurm`: the Slurm hooks (HealthCheckProgram, Prolog, Epilog, and the controller's
EpilogSlurmctld and PrologSlurmctld) and the agent's status.

    robustctl slurm healthcheck [--config FILE]   slurm.conf HealthCheckProgram; always exits 0
    robustctl slurm prolog [--config FILE]        slurm.conf Prolog; exits 1 to refuse a job on a bad node
    robustctl slurm epilog [--config FILE]        slurm.conf Epilog; diagnoses after a failed job; exits 0
    robustctl slurm epilog-ctld [--config FILE]   slurm.conf EpilogSlurmctld (controller): after a failed
                                                  multi-node job, diagnose its nodes together; exits 0
    robustctl slurm prolog-ctld [--config FILE]   slurm.conf PrologSlurmctld (controller): slurm.ctld.preflight;
                                                  exits 1 when it drained a suspect (Slurm requeues the job)
    robustctl slurm status [--config FILE]        what robustd did to this node; exit 1 while a drain is
                                                  suppressed (SLURM_DRAIN_SUPPRESSED) or the node is held flapping

They read robustd's socket (`listen.unix`) and the `slurm:` section from the config file, unless
`--socket` is given. The logic lives in robustd.adapters.slurm.hooks; this module is argparse.
"""

from __future__ import annotations

import argparse

from robustd.cli.args import AddGlobals, verbs
from robustd.roots import DEFAULT_CONFIG

VERBS = {
    "healthcheck": "for slurm.conf HealthCheckProgram: apply robustd's drain/resume rules once (cached verdict); "
                   "exit 0",
    "prolog": "for slurm.conf Prolog: drain a bad node with robustd's reason and exit 1, so Slurm requeues the job",
    "epilog": "for slurm.conf Epilog: after a failed job, run slurm.epilog_diagnostics; a FAIL drains the node",
    "epilog-ctld": "for slurm.conf EpilogSlurmctld: after a failed multi-node job, hold its nodes, diagnose them "
                   "together, drain the culprit, release the rest; exit 0",
    "prolog-ctld": "for slurm.conf PrologSlurmctld: slurm.ctld.preflight before a multi-node job; a suspect is "
                   "drained and the hook exits 1, so Slurm requeues the job onto other nodes",
    "status": "what robustd-slurm did to this node and why (exit 1 while SLURM_DRAIN_SUPPRESSED or flapping)",
}


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "slurm_command", add_globals)
    for name, help_text in VERBS.items():
        v = verb(name, help_text)
        v.add_argument("--config", default=None, metavar="FILE",
                       help=f"robustd's config: the slurm: section and listen.unix (default {DEFAULT_CONFIG}; "
                            "built-in defaults when that does not exist)")


def run(args: argparse.Namespace) -> int:
    from robustd.adapters.slurm import hooks

    return hooks.run(args.slurm_command, args.config, args.socket, args.timeout, as_json=args.json)

"""Adapters: separate processes that turn robustd's verdicts into a scheduler's actions.

Each is an ordinary client of the daemon's API (Watch, GetVerdict, Diagnostics.Run, Tracer.CaptureStacks)
with its own console script, unit and state file; it owns only what it did. `common/` is what every adapter
shares (the client, the node's conditions in robustd's enums, the state file, the service loop); `slurm/`
(robustd-slurm and the `robustctl slurm` hooks) and `k8s/` (robustd-k8s) build on it and never on each
other. The daemon imports nothing from here: it validates each adapter's config section through the model
the adapter registers (robustd/sections.py), and never acts on it.
"""

"""robustd-slurm: drain a bad Slurm node at once, resume only what robustd drained.

Modules, in dependency order:
  config    the `slurm:` section of robustd.yaml (imported by robustd.config, so kept light)
  model     plain values: conditions, the agent's state, Slurm's view of a node
  rules     the decisions, pure functions of those values (drain, resume, flapping, breaker)
  slurmcli  scontrol/sinfo through an injectable runner, every call under a timeout
  statefile the state file shared by the agent and the robustctl hooks (locked, written atomically)
  actor     one pass: read Slurm, decide, act, record (used by the agent and by the hooks)
  client    the daemon's gRPC API as this adapter uses it
  agent     the long-running Watch client (`robustd-slurm`)
  hooks     `robustctl slurm healthcheck | prolog | epilog | status`
"""

"""robustd-slurm: drain a bad Slurm node at once, resume only what robustd drained.

Modules, in dependency order (the client, the conditions, the state file and the service loop are the
adapters' common ones, robustd.adapters.common):
  config    the `slurm:` section of robustd.yaml (registered as a section: the daemon loads it, so kept light)
  model     plain values: the agent's state and its state file, Slurm's view of a node
  decide    the decisions, pure functions of those values (drain, resume, flapping, breaker)
  slurmcli  scontrol/sinfo through an injectable runner, every call under a timeout
  actor     one pass: read Slurm, decide, act, record (used by the agent and by the hooks)
  agent     the long-running Watch client (`robustd-slurm`)
  hung_job  a hung job's leftover processes and their stacks (the epilog, after triage says hang)
  hooks     `robustctl slurm healthcheck | prolog | epilog | status`
"""

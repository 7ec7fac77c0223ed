"""What every adapter shares, whichever scheduler it speaks to: the daemon's API as a client sees it, the
node's conditions as plain values, the state file, and the life of a Watch client as a service.

Modules, in dependency order:
  model     the node's conditions as an adapter keeps them (Cond, Table), in robustd's own enums
  config    the pieces of an adapter's config section that are the same for every adapter (ActionName)
  statefile an adapter's state file: locked while used, replaced atomically, a corrupt one set aside
  client    the daemon's gRPC API over the Unix socket: GetVerdict, Watch, Diagnostics.Run, Tracer
  watch     the Watch stream, the service loop (WatchAgent), the command line and the settings loader

Nothing here knows Slurm or Kubernetes; robustd.adapters.slurm and robustd.adapters.k8s build on it and
never on each other.
"""

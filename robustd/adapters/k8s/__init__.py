"""robustd-k8s: this node's robustd verdict as Kubernetes node conditions and events; quarantine when asked.

Modules, in dependency order (on robustd.adapters.common: the client, the conditions, the state file and
the service loop):
  config     the `k8s:` section of robustd.yaml (registered as a section: the daemon loads it, so kept light)
  families   pure: robustd's conditions -> one node condition per family, the event for a change
  state      the agent's state file (Watch position, what it posted, the quarantine it holds)
  kube       the Kubernetes API through the official client: every call under a timeout, errors classified
  reconciler the desired node state re-applied until the API server agrees (backoff, heartbeat, breaker)
  agent      the long-running Watch client (`robustd-k8s`)
"""

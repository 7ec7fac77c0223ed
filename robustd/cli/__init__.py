"""robustctl: the operator's view of a robustd node, over the same gRPC API schedulers use."""

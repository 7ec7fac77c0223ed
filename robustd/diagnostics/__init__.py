"""Stop-time diagnostics, the daemon side: the table of tests (table.py), their plain types (model.py),
runs and reports (manager.py), the child launcher (launcher.py) and the golden digest (golden.py).
The children themselves are in stoptests/; robustd/api/ converts to and from protobuf."""

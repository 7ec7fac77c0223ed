"""Stop-time tests: the children the daemon runs when a scheduler has stopped the job (`diagnostic`).

Each test is one module here, run as `<diagnostics.python> -m stoptests.<test> --spec SPEC.json`
(PROTOCOL.md) under an interpreter that has torch but maybe not the daemon's own packages: these
modules import only the standard library, torch (in the rank processes) and each other. They are not
checks: a check watches the running node (`checks/`); these disrupt it to test it.
"""

"""Adapters: separate processes that turn robustd's verdicts into a scheduler's actions.

Each is an ordinary Watch client of the daemon's API with its own console script, unit and state.
The daemon (robustd.daemon, policy, store, api) never imports anything from here; the only thing
the core shares with an adapter is the config file, whose section it validates.
"""

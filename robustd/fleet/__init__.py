"""Fleet analysis: pure functions a scheduler can call (dual-phase replay, warm-standby sizing)."""

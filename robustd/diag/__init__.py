"""Stop-time diagnostics: the daemon side (runs, reports, children)."""

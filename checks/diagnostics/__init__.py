"""Stop-time diagnostics: each test runs as a child process (see PROTOCOL.md); nothing here imports torch."""

"""robustd: node-level health checks and diagnostics for GPU training hosts."""

__version__ = "0.1.0"

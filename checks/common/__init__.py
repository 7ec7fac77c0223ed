"""What more than one check uses: monotonic kernel counters (`counters`), the fast sysfs reader (`sysfs`),
the `thresholds:` table of a check's rule file (`thresholds`), and exports imported on first use (`exports`)."""

"""What more than one check uses: monotonic kernel counters (`counters`), the fast sysfs reader (`sysfs`),
and the `thresholds:` table of a check's rule file (`thresholds`)."""

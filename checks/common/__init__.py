"""What more than one check uses: monotonic kernel counters (`counters`) and the fast sysfs reader (`sysfs`)."""

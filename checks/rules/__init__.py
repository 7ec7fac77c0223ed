"""Data about the kernel rules (checks/kernel/rules*.yaml): the inventory of what drivers print."""

"""An NVML emulator for hosts without an NVIDIA driver: a C `libnvidia-ml.so.1` driven by a state file.

`robustd.nvmlemu.build.build_emulator(dir)` compiles it; `robustd.nvmlemu.state` reads and writes its
state file. The daemon loads it only when `checks.gpu.backend` is `emulator`, never silently.
"""

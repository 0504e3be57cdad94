"""Native kernels: ``cpu.py`` builds the C++ CPU ops (``csrc/cpu_ops.cpp``) on first use."""

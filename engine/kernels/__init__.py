"""Kernels: ``cpu.py`` builds the C++ CPU ops in ``csrc/`` (decode attention, fused elementwise ops, row-wise
argmax) on first use; ``triton_*.py`` are the GPU kernels, each beside its torch reference."""

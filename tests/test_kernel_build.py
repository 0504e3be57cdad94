"""The native kernels' loader under ``make serve``: a process with ``SERVAL_CPU_KERNELS_NO_WAIT=1`` does
not wait for a build another process holds the lock of (the background build ``make serve`` starts);
it runs on plain torch. Without it the loader would wait for that build, as torch's loader does."""

from __future__ import annotations

from engine.kernels import cpu


def test_a_no_wait_process_uses_plain_torch_while_another_build_holds_the_lock(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # a private cache: the real one is left alone
    lock = cpu.build_directory() / "lock"
    assert lock.parent.is_relative_to(tmp_path)
    lock.touch()
    monkeypatch.setenv("SERVAL_CPU_KERNELS_NO_WAIT", "1")
    assert cpu._build.__wrapped__() is None  # at once, where torch's loader would wait for the lock to go


def test_a_built_module_loads_without_the_lock_a_killed_process_left(tmp_path):
    """torch's loader takes the lock on every load; a process SIGKILLed meanwhile leaves it behind, and every
    later load waited on it forever (a clean-clone run's engine tests timed out so). What is built from the
    same sources now loads without it."""
    import subprocess
    import sys

    assert cpu.load_cpu_kernels() is not None  # built (make venv builds it), with its sources' stamp
    lock = cpu.build_directory() / "lock"
    lock.touch()
    try:
        code = "from engine.kernels import cpu; assert cpu.load_cpu_kernels() is not None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    finally:
        lock.unlink()

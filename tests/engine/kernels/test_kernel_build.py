"""The native kernels' loader under ``serval serve``: a process with ``SERVAL_CPU_KERNELS_NO_WAIT=1`` does
not wait for a build another process holds the lock of (the background build ``serval serve`` starts);
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


def test_a_build_removes_a_lock_nobody_holds_and_keeps_one_a_build_holds(monkeypatch, tmp_path):
    """A build killed midway leaves its lock, and torch's loader would wait on it forever (a clean-clone
    run's other-ISA build timed out so): no process holds such a lock open, and a build removes it. A lock
    held open, as a running build holds its own, stays."""
    import os

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = cpu.build_lock()
    held = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's loader takes it
    try:
        assert cpu.lock_holders(lock) == [os.getpid()]
        assert not cpu.remove_stale_lock() and lock.exists()
    finally:
        os.close(held)  # the builder died without removing it
    assert cpu.lock_holders(lock) == []
    assert cpu.remove_stale_lock() and not lock.exists()
    assert not cpu.remove_stale_lock()  # nothing left to remove


def test_a_lesser_target_builds_as_its_own_module():
    """``SERVAL_CPU_MARCH=x86-64-v3`` (an image for AVX2 hosts, or the AVX2 path measured on an AVX-512
    one) compiles for that target under its own module name, so it never loads, nor overwrites, the
    ``-march=native`` build that shares the cache; unset, the name is what it always was."""
    import os
    import subprocess
    import sys

    code = "from engine.kernels import cpu; print(cpu._MODULE_NAME, *cpu._CFLAGS)"

    def name_and_flags(**env: str) -> list[str]:
        environment = {k: v for k, v in os.environ.items() if k != "SERVAL_CPU_MARCH"} | env
        out = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
        return out.stdout.split()

    native, avx2 = name_and_flags(), name_and_flags(SERVAL_CPU_MARCH="x86-64-v3")
    assert native[0] == cpu._MODULE_NAME and "-march=native" in native
    assert avx2[0] != native[0] and "-march=x86-64-v3" in avx2 and "-march=native" not in avx2


def test_the_background_build_runs_detached_at_nice_19_and_logs_to_its_file(monkeypatch, tmp_path):
    """``serval serve`` starts it where nothing is built: in a session of its own (a Ctrl-C in the terminal
    does not end it), at nice 19, its output in ``build_log()``. Here it compiles for a CPU no compiler
    knows, so that it fails in seconds, as a build on a machine without a usable compiler does."""
    import os
    import time
    from pathlib import Path

    import psutil

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("SERVAL_CPU_MARCH", "no-such-cpu")  # read by the build's own process
    assert not cpu.is_built() and not cpu.build_lock().exists()
    build = cpu.start_background_build()
    try:
        child = psutil.Process(build.pid)
        # `nice -n 19 python -m engine.kernels.cpu` names the module before it execs the interpreter: wait
        # for the interpreter itself (nice's own process runs at the caller's niceness).
        while not (cmdline := child.cmdline()) or Path(cmdline[0]).name == "nice":
            assert build.poll() is None, cpu.build_log().read_text()
            time.sleep(0.01)
        assert "engine.kernels.cpu" in " ".join(cmdline)
        assert child.nice() == 19 and os.getsid(build.pid) == build.pid != os.getsid(0)
        assert build.wait(timeout=240) == 0  # a build that fails is no error: the ops stay plain torch
    finally:
        build.kill()
    log = cpu.build_log().read_text()
    assert "-march=no-such-cpu" in log and "not built: Serval runs with plain torch ops" in log
    assert not cpu.is_built()

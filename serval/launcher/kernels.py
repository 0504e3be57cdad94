"""Serval's native CPU kernels as the launcher sees them on this machine: ``serval serve`` starts their
build in the background where they are not built (``start``), says so, watches it (``poll``) and names
the time it took in the start-up report (``report_line``).

The replicas do not wait for it: the launcher's Ray head has ``SERVAL_CPU_KERNELS_NO_WAIT=1``, so a
replica or engine core that starts while the build holds its lock runs on plain torch ops (it logs so
once) and one started after the build ends loads the kernels. A replica already running keeps plain
torch until it restarts: its ops are chosen when it loads the model. The launcher deploys only once the
build holds its lock (``wait_until_locked``), so that no replica starts a second compile.
"""

from __future__ import annotations

import enum
import subprocess
import time
from pathlib import Path

LOCK_TIMEOUT_S = 120.0  # longest wait for a starting build to take its lock (it imports torch first)
STAMP_GRACE_S = 10.0  # another process's build writes its sources' stamp just after it drops the lock


class Kernels(enum.Enum):
    ELSEWHERE = "the cluster is not on this machine: not checked"
    OFF = "switched off"
    BUILT = "built"
    MISSING = "not built, nor building: the first replica compiles them"
    BUILDING = "building"
    STALE_LOCK = "blocked by a lock a killed build left"
    DONE = "built in the background"
    FAILED = "not built"


def _mtime(path: Path | None) -> float:
    """When ``path`` was last written (epoch seconds); now where it is gone."""
    try:
        return path.stat().st_mtime
    except (AttributeError, OSError):
        return time.time()


class KernelBuild:
    """The kernels' state as this launcher found (and, building, follows) it. ``started`` (epoch seconds):
    when the build began (its lock's mtime for another process's build); ``process``: the build this
    launcher started."""

    def __init__(self, state: Kernels, lock: Path | None = None, log: Path | None = None) -> None:
        self.state, self.lock, self.log = state, lock, log
        self.started = _mtime(lock) if state == Kernels.BUILDING else time.time()
        self.process: subprocess.Popen | None = None
        self.took: float | None = None
        self._unlocked_at: float | None = None

    @classmethod
    def observe(cls, local: bool = True) -> KernelBuild:
        """The kernels' state on this machine now (``local``: the cluster runs here), starting nothing."""
        if not local:
            return cls(Kernels.ELSEWHERE)
        from engine.kernels import cpu

        if not cpu.is_enabled():
            return cls(Kernels.OFF)
        if cpu.is_built():
            return cls(Kernels.BUILT)
        lock = cpu.build_lock()
        if not lock.exists():
            return cls(Kernels.MISSING, lock, cpu.build_log())
        return cls(Kernels.BUILDING if cpu.lock_holders(lock) else Kernels.STALE_LOCK, lock, cpu.build_log())

    @classmethod
    def start(cls, local: bool) -> KernelBuild:
        """``observe``, and where nothing is built nor building, the build started in the background; prints
        what it found or did, for ``serval serve``'s terminal."""
        from engine.kernels import cpu

        found = cls.observe(local)
        if found.state == Kernels.STALE_LOCK and cpu.remove_stale_lock():
            print(f"Removed {found.lock}: a kernel build killed midway left it.", flush=True)
            found = cls(Kernels.MISSING, found.lock, found.log)
        if found.state == Kernels.MISSING:
            found = cls(Kernels.BUILDING, found.lock, found.log)
            found.process = cpu.start_background_build()
            print(
                "Building Serval's native CPU kernels in the background (first start only, minutes on a small"
                f" machine; log: {found.log}); the replicas serve with plain torch ops until then, and those"
                " started after it use them.",
                flush=True,
            )
        elif found.state == Kernels.BUILDING:
            print(
                f"Serval's native CPU kernels are being built by another process (lock: {found.lock}); the"
                " replicas serve with plain torch ops until then.",
                flush=True,
            )
        elif found.state == Kernels.STALE_LOCK:
            print(f"Note: {found.activity()}.", flush=True)
        return found

    def wait_until_locked(self, timeout_s: float = LOCK_TIMEOUT_S) -> None:
        """Until the build this launcher started holds its lock or has ended (at most ``timeout_s``): a
        replica that started before would find neither a lock nor a module, and compile too."""
        deadline = time.monotonic() + timeout_s
        while self.process and self.process.poll() is None and not self.lock.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def poll(self) -> str | None:
        """Once, when a build that was running has ended: what it came to, as a line to print."""
        if self.state != Kernels.BUILDING or not self._ended():
            return None
        from engine.kernels import cpu

        now = time.time()
        if not cpu.is_built() and self.process is None and now - self._unlocked_at < STAMP_GRACE_S:
            return None
        self.took = now - self.started
        self.state = Kernels.DONE if cpu.is_built() else Kernels.FAILED
        if self.state == Kernels.FAILED:
            return (
                f"Serval's native CPU kernels could not be built ({self.took:.0f} s; {self._where()}): Serval"
                " serves with plain torch ops."
            )
        return (
            f"Serval's native CPU kernels built in {self.took:.0f} s: replicas started from now on use them;"
            " those running keep plain torch ops until they restart (stop and serve again)."
        )

    def _ended(self) -> bool:
        if self.process is not None:
            return self.process.poll() is not None
        if self.lock.exists():
            return False
        self._unlocked_at = self._unlocked_at or time.time()
        return True

    def activity(self) -> str | None:
        """What a replica starting now should know of the kernels (``status.replica_activities``), or None."""
        if self.state == Kernels.BUILDING:
            return (
                f"Serval's native CPU kernels are being compiled (lock: {self.lock}): replicas started"
                " meanwhile run on plain torch ops, slower, until they restart"
            )
        if self.state == Kernels.STALE_LOCK:
            return (
                f"{self.lock} is left from a kernel build that was killed midway: replicas run on plain torch"
                f" ops while it is there. Remove the file (rm {self.lock}); the next start rebuilds"
            )
        return None

    def report_line(self) -> str | None:
        """The start-up report's line on the kernels: the time spent compiling them (0 when built before)."""
        lines = {
            Kernels.ELSEWHERE: None,
            Kernels.OFF: "  native CPU kernels: switched off (SERVAL_DISABLE_CPU_KERNELS=1): plain torch ops",
            Kernels.BUILT: "  native CPU kernels: already built (0 s compiling)",
            Kernels.MISSING: "  native CPU kernels: not built; each replica compiles them as it starts",
            Kernels.STALE_LOCK: f"  native CPU kernels: {self.state.value} ({self.lock}): plain torch ops",
            Kernels.FAILED: f"  native CPU kernels: could not be built ({self.took or 0:.0f} s; {self._where()}):"
            " plain torch ops",
            Kernels.DONE: f"  native CPU kernels: compiled in {self.took or 0:.0f} s, in the background",
        }
        if self.state == Kernels.BUILDING:
            return (
                f"  native CPU kernels: compiling in the background for {time.time() - self.started:.0f} s so far"
                f" (not in the time above; the replicas started on plain torch ops; {self._where()})"
            )
        return lines[self.state]

    def status_line(self) -> str | None:
        """``serval status``'s line on the kernels of this machine, as found (``observe``); None elsewhere."""
        if self.state == Kernels.ELSEWHERE:
            return None
        if self.state == Kernels.BUILDING:
            return (
                f"Native CPU kernels: building for {time.time() - self.started:.0f} s so far (lock: {self.lock};"
                f" a background build logs to {self.log}); replicas started meanwhile run on plain torch ops"
            )
        where = f" ({self.lock})" if self.state == Kernels.STALE_LOCK else ""
        return f"Native CPU kernels: {self.state.value}{where}"

    def _where(self) -> str:
        """Where to look: the log of the build this launcher started, else the lock of another's."""
        return f"log: {self.log}" if self.process else f"lock: {self.lock}"

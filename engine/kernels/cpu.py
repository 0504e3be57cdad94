"""Native CPU kernels, compiled on first use with torch's C++ extension loader.

The build (about a minute, once per machine; cached under
``~/.cache/torch_extensions``) needs a C++ compiler and ninja. Where either is
missing, ``load_cpu_kernels()`` returns None and callers fall back to plain
torch: the kernels are an optimisation, never a requirement. The fused
elementwise ops (``fused_add_rms_norm``, ``rms_norm``, ``silu_and_mul``,
``rotary_embedding_and_cache``) exist where the compiler targets AVX-512 (16 lanes) or AVX2 with
FMA and F16C (8 lanes; csrc/vec.h picks one at build time from ``-march=native``); on a CPU with
neither they are not built and the layers keep plain torch. ``fused_cpu_ops(x)`` returns the module
when ``x`` can use them, else None.

``SERVAL_DISABLE_CPU_KERNELS=1`` (read once) or ``use_cpu_kernels(False)``
switches every native op off, so the plain-torch path can run and be tested
anywhere.

``python -m engine.kernels.cpu`` builds them (``make venv``); ``start_background_build()`` runs it
detached at nice 19 (``serval serve`` does, before it deploys, where they are not built), so that the
server need not wait minutes for a compiler. A process with ``SERVAL_CPU_KERNELS_NO_WAIT=1`` (the
launcher's Ray head and so its replicas and engine cores) neither waits for a build another process
holds the lock of nor starts a second one: it uses plain torch, and a process started after the build
ends loads the kernels; one already running keeps plain torch until it restarts. A lock that no process
holds open was left by a build killed midway: a build removes it (``remove_stale_lock``) rather than wait on
it forever, as torch's loader would.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    "bindings.cpp",
    "decode_attention.cpp",
    "decode_stack.cpp",
    "elementwise.cpp",
    "kquant_linear.cpp",
    "quant_linear.cpp",
    "sampling.cpp",
    "skinny_linear.cpp",
]
# -march=native: the build is cached per machine, so it may use every vector unit this CPU has.
# SERVAL_CPU_MARCH names a lesser target instead (x86-64-v3: AVX2 + FMA + F16C), for an image built on one
# kind of CPU and run on another, or to measure the AVX2 path on an AVX-512 host.
# The reassociation flags let the compiler vectorize the float dot products and sums of the
# generic loops; no contraction into FMAs, so that the fused elementwise ops round like torch's.
_MARCH = os.environ.get("SERVAL_CPU_MARCH", "native")
# SERVAL_CPU_KERNELS_SUBSET=quant builds only the block-quantized products (quant_linear and its reference):
# the tests of another ISA's bits compile that much of it, in a third of the whole module's time.
_SUBSET = os.environ.get("SERVAL_CPU_KERNELS_SUBSET", "")
if _SUBSET not in ("", "quant"):
    raise ValueError(f"SERVAL_CPU_KERNELS_SUBSET={_SUBSET!r}: only 'quant' (or unset) is known")
if _SUBSET:
    _SOURCES = ["bindings.cpp", "kquant_linear.cpp", "quant_linear.cpp"]
_CFLAGS = [
    "-O3",
    f"-march={_MARCH}",
    "-fopenmp",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-ffp-contract=off",
] + (["-DSERVAL_QUANT_ONLY"] if _SUBSET else [])
_FUSED_OPS = ("fused_add_rms_norm", "rms_norm", "silu_and_mul", "rotary_embedding_and_cache")

_is_enabled = os.environ.get("SERVAL_DISABLE_CPU_KERNELS") != "1"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which ``-march=native`` compiles for; "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


# One build directory per checkout and CPU kind: torch keys its cache by name alone, and ninja rebuilds
# when the source paths change, so two checkouts sharing a name would rebuild each other's module on every
# load; and a module built with -march=native for an AVX-512 CPU dies of an illegal instruction on an AVX2
# one sharing the cache (an image, a home directory).
_BUILD_KEY = f"{_CSRC}\n{_cpu_flags()}" + ("" if _MARCH == "native" else f"\n{_MARCH}") + _SUBSET
_MODULE_NAME = "serval_cpu_kernels_" + hashlib.sha1(_BUILD_KEY.encode()).hexdigest()[:8]


_NO_WAIT_ENV = "SERVAL_CPU_KERNELS_NO_WAIT"


def build_directory() -> Path:
    """Where torch's loader builds and caches this checkout's module (its ``lock`` file is held while it builds)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_MODULE_NAME, verbose=False))


def _sources_digest() -> str:
    """What the module is built from: every source and header's bytes, and the flags."""
    digest = hashlib.sha1("\n".join(_CFLAGS).encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _is_built_from(directory: Path, digest: str) -> bool:
    stamp = directory / "sources.sha1"
    return (directory / f"{_MODULE_NAME}.so").exists() and stamp.exists() and stamp.read_text() == digest


def is_built() -> bool:
    """Whether the module is built from this checkout's sources and flags (a load then needs no compiler)."""
    return _is_built_from(build_directory(), _sources_digest())


def build_lock() -> Path:
    """The file torch's loader holds while it builds the module (another loader waits until it is gone)."""
    return build_directory() / "lock"


def lock_holders(lock: Path) -> list[int]:
    """The pids of the processes that have ``lock`` open: torch's loader keeps its lock file open while it
    builds, so a lock nobody holds was left by a build killed midway."""
    target, holders = os.path.realpath(lock), []
    for process in psutil.process_iter():
        try:
            if any(f.path == target for f in process.open_files()):
                holders.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return holders


def remove_stale_lock() -> bool:
    """Removes ``build_lock()`` where no process holds it (module docstring); True if it did. A build that
    is releasing its lock closes it just before removing it, so the lock must be unheld twice, a moment
    apart, and still the same file."""
    lock = build_lock()
    try:
        first = lock.stat()
        if lock_holders(lock):
            return False
        time.sleep(0.2)
        if lock.stat().st_ino != first.st_ino or lock_holders(lock):
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    logger.warning("Removed %s: a kernel build killed midway left it, and no process holds it.", lock)
    return True


def build_log() -> Path:
    """Where ``start_background_build``'s build writes its output."""
    return build_directory() / "background-build.log"


def start_background_build() -> subprocess.Popen:
    """Starts ``python -m engine.kernels.cpu`` detached (a session of its own: it outlives its caller and a
    Ctrl-C in the caller's terminal), at nice 19 (what serves goes first), its output in ``build_log()``.

    Returns at once; the build takes the lock a few seconds later, once torch is imported."""
    with build_log().open("wb") as log:
        return subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "engine.kernels.cpu"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _load_built(directory: Path, digest: str):
    """The module already built from these sources, imported without torch's loader; None if there is none.

    torch's loader takes the build directory's ``lock`` file on every load, even when nothing needs
    building, and a process killed while holding it (a replica or engine core SIGKILLed at start-up)
    leaves every later load waiting on it forever; a load of what is built needs no lock.
    """
    if not _is_built_from(directory, digest):
        return None
    from torch.utils.cpp_extension import _import_module_from_library

    return _import_module_from_library(_MODULE_NAME, str(directory), True)


@functools.cache
def _build():
    directory = build_directory()
    digest = _sources_digest()
    built = _load_built(directory, digest)
    if built is not None:
        return built
    lock = directory / "lock"
    if os.environ.get(_NO_WAIT_ENV) == "1" and lock.exists():
        logger.warning(
            "Serval's native CPU kernels are being built by another process (%s): this process uses plain torch"
            " ops; those started after the build ends use the kernels.",
            lock,
        )
        return None
    if lock.exists():
        remove_stale_lock()
    try:
        import ninja  # the pip package carries the binary torch's loader looks for on PATH

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        from torch.utils.cpp_extension import load

        module = load(
            name=_MODULE_NAME,
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        (directory / "sources.sha1").write_text(digest)  # built from exactly these: later loads skip the lock
        return module
    except Exception as error:  # no compiler, no ninja, ...: plain torch still works
        logger.warning("Serval's CPU kernels could not be built (%s); using plain torch.", error)
        return None


def is_enabled() -> bool:
    """Whether native ops are on (``SERVAL_DISABLE_CPU_KERNELS``, ``use_cpu_kernels``)."""
    return _is_enabled


def load_cpu_kernels():
    """The compiled module (``paged_decode_attention``, ``argmax_rows``, the fused ops where the CPU has
    AVX-512 or AVX2), or None if it cannot be built here or native ops are switched off."""
    return _build() if _is_enabled else None


@functools.cache
def _has_fused_ops() -> bool:
    kernels = _build()
    return kernels is not None and all(hasattr(kernels, name) for name in _FUSED_OPS)


def fused_cpu_ops(x: torch.Tensor):
    """The compiled module if ``x`` (an activation) may use the fused elementwise ops, else None."""
    if not _is_enabled or x.device.type != "cpu" or x.dtype == torch.float64 or not _has_fused_ops():
        return None
    return _build()


@contextlib.contextmanager
def use_cpu_kernels(enabled: bool):
    """Switch the native ops on or off within a block (tests run both paths in one process)."""
    global _is_enabled
    previous, _is_enabled = _is_enabled, enabled
    try:
        yield
    finally:
        _is_enabled = previous


@functools.cache
def has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16 or AMX, through oneDNN).

    Without it (AVX2), oneDNN emulates bf16 products, far slower than float32 ones
    (``benchmarks/bench_matmul.py``), so bf16 models compute their products in float32.
    """
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def product_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype matrix products of ``dtype`` tensors on ``device`` run in: float32 for bf16 on a CPU
    without bf16 matrix instructions, else ``dtype`` itself."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not has_bf16_matmul():
        return torch.float32
    return dtype


def main() -> int:
    """Builds the kernels here, or finds them built; says which (``make venv``)."""
    import time

    started = time.monotonic()
    kernels = _build()
    took = time.monotonic() - started
    print(
        f"  built in {took:.0f} s: {kernels.__file__}" if kernels else "  not built: Serval runs with plain torch ops"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Native CPU kernels, compiled on first use with torch's C++ extension loader.

The build (about a minute, once per machine; cached under
``~/.cache/torch_extensions``) needs a C++ compiler and ninja. Where either is
missing, ``load_cpu_kernels()`` returns None and callers fall back to plain
torch: the kernels are an optimisation, never a requirement.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# -march=native: the build is cached per machine, so it may use every vector unit this CPU has.
# The reassociation flags let the compiler vectorize the float dot products and sums.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
           "-ffp-contract=fast"]


@functools.cache
def load_cpu_kernels():
    """The compiled module (``paged_decode_attention``, ``argmax_rows``), or None if it cannot be built here."""
    if os.environ.get("SERVAL_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        import ninja  # the pip package carries the binary torch's loader looks for on PATH
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        from torch.utils.cpp_extension import load
        return load(name="serval_cpu_kernels", sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no ninja, ...: plain torch still works
        logger.warning("Serval's CPU kernels could not be built (%s); using plain torch.", error)
        return None

"""The commands that need an optional dependency group (pyproject's extras) beyond the serving install.

``pip install serval`` serves; ``serval bench``, ``serval render-rayservice`` and ``serval dashboard`` need
``serval[bench]``, ``serval[kubernetes]`` and ``serval[dashboard]``. The modules of those commands import
their extra's package inside the functions that use it, so ``serval --help`` and every other command work
without it, and ``require`` turns a missing one into a one-line message naming the extra.
"""

from __future__ import annotations

import importlib

# Top-level command -> (the extra, the module it installs that the command imports).
COMMAND_EXTRAS = {
    "bench": ("bench", "matplotlib"),
    "render-rayservice": ("kubernetes", "helm_python"),
    "dashboard": ("dashboard", "grafana_client"),
}


def missing_extra(command: str) -> str | None:
    """The one-line message for ``command`` when its extra is not installed, else None."""
    if command not in COMMAND_EXTRAS:
        return None
    extra, module = COMMAND_EXTRAS[command]
    try:
        importlib.import_module(module)
    except ImportError:
        return f"serval {command}: needs the {extra} extra (pip install 'serval[{extra}]')"
    return None

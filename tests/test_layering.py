"""The layering rules: engine/sched is pure Python, engine/ never imports Ray.

Checked twice: statically (every import statement in the source) and
dynamically (importing the modules in a fresh interpreter pulls in neither
torch nor ray, so no indirect import sneaks them in).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import engine
import engine.sched

ROOT = Path(__file__).resolve().parent.parent


def imported_top_level_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_scheduler_source_imports_neither_torch_nor_ray():
    for path in (ROOT / "engine" / "sched").rglob("*.py"):
        forbidden = imported_top_level_modules(path) & {"torch", "ray", "triton", "transformers", "numpy"}
        assert not forbidden, f"{path.relative_to(ROOT)} imports {forbidden}"


def test_engine_source_never_imports_ray():
    for path in (ROOT / "engine").rglob("*.py"):
        assert "ray" not in imported_top_level_modules(path), f"{path.relative_to(ROOT)} imports ray"


def _modules_of(package) -> list[str]:
    return [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in modules)
        + "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return set(result.stdout.split())


def test_importing_the_scheduler_loads_neither_torch_nor_ray():
    loaded = _loaded_after_import(
        ["engine.sched", *_modules_of(engine.sched), "engine.config", "engine.sampling_params"]
    )
    assert "torch" not in loaded and "ray" not in loaded


def test_importing_the_whole_engine_never_loads_ray():
    loaded = _loaded_after_import(_modules_of(engine))
    assert "ray" not in loaded

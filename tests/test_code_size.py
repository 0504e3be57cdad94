"""Size limits on the source of the project's packages: no file over ``MAX_FILE_LINES`` lines and no
function or method (sync or async, nested ones included) over ``MAX_FUNCTION_LINES`` lines.

A function's length is ``end_lineno - lineno + 1`` of its ``def`` (signature, docstring and body;
decorators excluded). Each test names every offender at once, so one run lists all the work.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "cluster", "deployments", "serval")
MAX_FILE_LINES = 350  # past this a module holds more than one concern: split it by concern
MAX_FUNCTION_LINES = 45  # past this a function does more than one thing: extract the parts


def source_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``tree`` with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)  # defs inside if/try/with blocks


def function_lengths(path: Path) -> Iterator[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for name, node in functions(tree):
        yield name, node.end_lineno - node.lineno + 1


def test_the_packages_have_source_files():
    for package in PACKAGES:
        assert any((ROOT / package).rglob("*.py")), f"{package}/ has no .py file: the walk would check nothing"


def test_the_walk_measures_nested_async_and_method_definitions():
    source = (
        "class A:\n"
        "    @staticmethod\n"  # decorators do not count
        "    async def f():\n"
        "        if True:\n"
        "            def g():\n"
        "                pass\n"
        "        return g\n"
    )
    lengths = {name: node.end_lineno - node.lineno + 1 for name, node in functions(ast.parse(source))}
    assert lengths == {"A.f": 5, "A.f.g": 2}


def test_no_file_is_over_the_line_limit():
    offenders = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in source_files()
        if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not offenders, f"{len(offenders)} files over {MAX_FILE_LINES} lines:\n" + "\n".join(offenders)


def test_no_function_is_over_the_line_limit():
    offenders = [
        f"{path.relative_to(ROOT)}: {name} {length} lines"
        for path in source_files()
        for name, length in function_lengths(path)
        if length > MAX_FUNCTION_LINES
    ]
    assert not offenders, f"{len(offenders)} functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)

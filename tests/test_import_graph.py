"""No import cycle among Serval's packages, and no import of a layer above the importer's own (``LAYERS``),
counting every import statement.

The graph's nodes are the modules of ``engine``, ``cluster``, ``deployments`` and ``serval``; an edge is
any import statement in a module's source, wherever it sits (module level, inside a function, under
``TYPE_CHECKING``): a deferred import only hides a cycle from the interpreter, not from a reader.
Relative imports are resolved; ``from pkg import name`` imports the submodule ``pkg.name`` when there
is one, else ``pkg`` itself. Importing ``a.b.c`` counts as importing ``a.b.c`` only, not its parent
packages (every module of a package imports its ``__init__`` implicitly; that is no cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "cluster", "deployments", "serval")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``PACKAGES``."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _base_package(module: str, is_package: bool, level: int) -> str:
    """The package a relative import of ``level`` dots in ``module`` starts from."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(parts[: len(parts) - (level - 1)])


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of ``known`` that one import statement imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        prefix = _base_package(module, is_package, node.level)
        base = f"{prefix}.{base}" if base else prefix
    targets = []
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            targets.append(f"{base}.{alias.name}")
        elif base in known:
            targets.append(base)
    return targets


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of the first such import}; self-imports left out."""
    files = module_files(root)
    known = set(files)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported(node, module, is_package, known):
                if target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (each one holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def a_cycle(graph: dict[str, dict[str, int]], component: list[str], start: str) -> list[str]:
    """A shortest cycle through ``start`` inside ``component``, as [start, m1, ..., start]."""
    members = set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if target in members and target not in parent:
                    parent[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its own component")


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    """``a (line 3) -> b (line 9) -> a``: each import and the line of the importing module it is on."""
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join([*steps, cycle[-1]])


def cycles_covering(graph: dict[str, dict[str, int]], component: list[str]) -> list[list[str]]:
    """Cycles of ``component`` until every one of its modules is on one (a report names them all)."""
    cycles: list[list[str]] = []
    covered: set[str] = set()
    for module in component:
        if module not in covered:
            cycles.append(a_cycle(graph, component, module))
            covered.update(cycles[-1])
    return cycles


def test_the_packages_import_graph_has_no_cycle():
    graph = import_graph()
    cycles = [describe(graph, c) for component in strongly_connected(graph) for c in cycles_covering(graph, component)]
    assert not cycles, "import cycles (a module's imports, at any depth of its source):\n" + "\n".join(cycles)


def test_the_engine_never_imports_the_serval_commands():
    """``serval/`` (the command line, the developer tools) builds on the engine, never the other way round."""
    graph = import_graph()
    reversed_edges = [
        f"{module} (line {line}) -> {target}"
        for module, edges in graph.items()
        if module.split(".")[0] == "engine"
        for target, line in edges.items()
        if target.split(".")[0] == "serval"
    ]
    assert not reversed_edges, "engine/ imports serval/:\n" + "\n".join(reversed_edges)


def test_the_walker_sees_deferred_relative_and_submodule_imports(tmp_path):
    """The checker itself: a cycle made of a function-level relative import and ``from pkg import submodule``."""
    package = tmp_path / "engine" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from engine.pkg import b\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["engine.pkg.a"] == {"engine.pkg.b": 1}
    assert graph["engine.pkg.b"] == {"engine.pkg.c": 2}
    assert graph["engine.pkg.c"] == {"engine.pkg.a": 1}
    (component,) = strongly_connected(graph)
    (cycle,) = cycles_covering(graph, component)
    assert cycle == ["engine.pkg.a", "engine.pkg.b", "engine.pkg.c", "engine.pkg.a"]
    assert describe(graph, cycle) == (
        "engine.pkg.a (line 1) -> engine.pkg.b (line 2) -> engine.pkg.c (line 1) -> engine.pkg.a"
    )


# The layers, top first. A module belongs to the layer of its longest listed prefix (``engine`` itself is the
# front door; ``engine.config`` the records every layer shares). A module may import its own layer and those
# below it, never one above: the front doors call the front end, which calls the core, which drives the
# executor, which drives a rank's model runner, which runs the model's parts on the kernels; every one of
# them may read the scheduler's plain records and the shared ones.
LAYERS = (
    ("serval",),
    ("deployments",),
    ("cluster",),
    ("engine", "engine.llm", "engine.async_llm", "engine.entrypoints"),
    ("engine.llm_engine", "engine.output_handler", "engine.frontend", "engine.engine_args", "engine.engine_client"),
    ("engine.core", "engine.executor"),
    ("engine.worker", "engine.spec_decode", "engine.kv_transfer"),
    ("engine.model", "engine.lora", "engine.sample", "engine.structured_output", "engine.attention"),
    ("engine.kernels", "engine.distributed"),
    ("engine.sched", "engine.metrics"),
    (
        "engine.config",
        "engine.sampling_params",
        "engine.request_output",
        "engine.inputs",
        "engine.lora_request",
        "engine.reasoning",
    ),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` (0: the top) of the layer ``module`` belongs to; KeyError if none."""
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise KeyError(f"{module} is in no layer of LAYERS")
    return max(matches)[1]


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    upward = [
        f"{module} (line {line}) -> {target}"
        for module, edges in sorted(graph.items())
        for target, line in edges.items()
        if layer_of(target) < layer_of(module)
    ]
    assert not upward, "imports of a layer above the importer's own (see LAYERS):\n" + "\n".join(upward)


def test_every_module_has_a_layer():
    prefixes = [prefix for layer in LAYERS for prefix in layer]
    unplaced = [m for m in module_files() if not any(m == p or m.startswith(p + ".") for p in prefixes)]
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"

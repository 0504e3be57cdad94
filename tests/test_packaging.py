"""Serval as a package: ``serval --version``, the extras (a command whose extra is missing names it; the
extras' packages are imported only inside their commands), the files shipped as package data, and a built
wheel installed into a fresh venv outside the checkout that runs from another directory without reading
the checkout."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import distribution, packages_distributions, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from serval import shipped
from serval.cli import main
from serval.extras import COMMAND_EXTRAS

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The module each extra installs -> the only source files that may import it (inside a function).
EXTRA_IMPORTERS = {
    "matplotlib": lambda path: path.parts[:2] == ("serval", "bench"),
    "grafana_client": lambda path: path == Path("serval/dashboard.py"),
    "helm_python": lambda path: path == Path("serval/render_rayservice.py"),
}


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert (
        capsys.readouterr().out.strip() == f"serval {version('serval')}" == f"serval {PYPROJECT['project']['version']}"
    )
    module = subprocess.run([sys.executable, "-m", "serval", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert module.returncode == 0 and module.stdout.strip() == f"serval {version('serval')}"


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "serve"],
        ["bench", "latency", "--model", "m"],
        ["render-rayservice", "x.yaml"],
        ["dashboard", "push", "--grafana-url", "http://127.0.0.1:1"],
    ],
)
def test_a_command_without_its_extra_names_the_extra(argv, monkeypatch, capsys):
    extra, module = COMMAND_EXTRAS[argv[0]]
    monkeypatch.setitem(sys.modules, module, None)  # the package absent: importing it raises ImportError
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"serval {argv[0]}: needs the {extra} extra (pip install 'serval[{extra}]')\n"


def test_the_extras_are_declared_and_the_test_extra_holds_them_all():
    extras = PYPROJECT["project"]["optional-dependencies"]
    core = " ".join(PYPROJECT["project"]["dependencies"])
    for extra, _ in COMMAND_EXTRAS.values():
        assert extras[extra], extra
        assert not any(requirement.split(">")[0] in core for requirement in extras[extra]), f"{extra} in core"
    named = {extra for extra, _ in COMMAND_EXTRAS.values()}
    assert f"serval[{','.join(sorted(named, key=list(extras).index))}]" in extras["test"]
    for absent in ("matplotlib", "grafana-client", "helm-python-sdk", "pytest", "peft", "ruff", "schemathesis"):
        assert absent not in core


def test_extras_are_imported_only_inside_their_commands():
    for package in ("engine", "cluster", "deployments", "serval"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            top_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                for name in names:
                    module = name.split(".")[0]
                    if module in EXTRA_IMPORTERS:
                        where = path.relative_to(ROOT)
                        assert EXTRA_IMPORTERS[module](where), f"{where} imports {module}"
                        assert id(node) not in top_level, f"{where} imports {module} at module level"


def _installed_by(requirements: list[str]) -> set[str]:
    """The distributions ``pip install`` of ``requirements`` brings: them and what they require, extras followed."""
    seen: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen and set(requirement.extras) <= seen[name]:
            continue
        extras = seen.setdefault(name, set())
        extras |= set(requirement.extras)
        for line in distribution(name).requires or []:
            needed = Requirement(line)
            if needed.marker is None or any(needed.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append(needed)
    return set(seen)


def test_every_module_the_packages_import_is_installed_by_the_core_or_is_an_extras():
    """``pip install .`` alone serves: psutil, which the launcher imports, came only with the test extra's
    packages, and ``serval serve`` died on a fresh serving install."""
    core = _installed_by(PYPROJECT["project"]["dependencies"])
    providers = packages_distributions()
    first_party = {"engine", "cluster", "deployments", "serval"}
    for package in first_party:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                for module in {name.split(".")[0] for name in names} - first_party - set(sys.stdlib_module_names):
                    if module not in EXTRA_IMPORTERS:
                        installers = {canonicalize_name(d) for d in providers.get(module, [])}
                        assert installers & core, f"{path.relative_to(ROOT)} imports {module}, not a core dependency's"


def test_the_shipped_files_are_the_top_level_ones():
    """In the checkout serval/_data's entries are the top-level directories themselves (one copy)."""
    for name in ("configs", "assets", "helm"):
        assert (shipped.DATA_DIR / name).resolve() == ROOT / name
    assert shipped.DEFAULT_SERVE_CONFIG.read_bytes() == (ROOT / "configs/serve/default.yaml").read_bytes()
    assert (shipped.CHART_DIR / "Chart.yaml").is_file()


def _copy_of_the_source(destination: Path) -> Path:
    """The checkout's sources (symlinks kept: serval/_data), so the build writes nothing into the checkout."""
    ignore = shutil.ignore_patterns(".git", ".venv", "models", "build", "*.egg-info", "__pycache__", "results")
    shutil.copytree(ROOT, destination, symlinks=True, ignore=ignore)
    return destination


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with Serval's built wheel installed (no dependencies: those come
    from this environment's site-packages, named by a .pth line, which runs no .pth file of theirs, so the
    editable install of the checkout stays out)."""
    tmp = tmp_path_factory.mktemp("packaging")
    assert not tmp.is_relative_to(ROOT)
    pip = [sys.executable, "-m", "pip"]
    source = _copy_of_the_source(tmp / "src")
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", source], check=True)
    [wheel] = (tmp / "dist").glob("serval-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp / "venv"], check=True)
    python = tmp / "venv" / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "-q", "--no-deps", wheel], check=True)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    outer = [path for path in sys.path if path.endswith("site-packages")]
    (Path(site) / "outer-environment.pth").write_text("\n".join(outer) + "\n")
    return tmp / "venv"


def _run_outside(venv: Path, *command: str, cwd: Path) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(PATH=f"{venv / 'bin'}:{environ['PATH']}", SERVAL_DISABLE_CPU_KERNELS="1")
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environ, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


GENERATE = """
import json, deployments.app, engine, serval, serval.serve
from deployments.llm_config import LLMConfig
from engine import LLM, SamplingParams
config = {"model_loading_config": {"model_id": "demo", "model_source": "assets/trained/serval-llama-10m"}}
source = LLMConfig.model_validate(config).model_loading_config.resolved_source()
llm = LLM(model=source, max_model_len=128)
[output] = llm.generate(["def __init__(self"], SamplingParams(max_tokens=8, temperature=0))
modules = [deployments.app, engine, serval, serval.serve]
print(json.dumps({"files": [m.__file__ for m in modules], "source": source, "text": output.outputs[0].text,
                  "tokens": len(output.outputs[0].token_ids)}))
"""


@pytest.mark.slow
def test_the_wheel_installed_outside_the_checkout_serves_without_it(installed, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    assert _run_outside(installed, "serval", "--version", cwd=work).strip() == f"serval {version('serval')}"
    report = json.loads(_run_outside(installed, str(installed / "bin" / "python"), "-c", GENERATE, cwd=work))
    for file in [*report["files"], report["source"]]:
        assert Path(file).resolve().is_relative_to(installed.resolve()), f"{file} is not the installed copy"
    assert report["tokens"] == 8 and report["text"]
    data = installed / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert (data / "serval/_data/configs/serve/default.yaml").read_bytes() == shipped.DEFAULT_SERVE_CONFIG.read_bytes()
    assert (data / "serval/_data/helm/serval/Chart.yaml").is_file()
    assert sorted(p.name for p in (data / "engine/kernels/csrc").glob("*.cpp")) == sorted(
        p.name for p in (ROOT / "engine/kernels/csrc").glob("*.cpp")
    )

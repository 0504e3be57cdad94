"""The top-level Dockerfile, parsed as Docker parses it (dockerfile-parse; no container engine on the CI
machines, so the image itself is never built here): what it copies exists, and its command is a valid
``serval`` command line over files the image holds."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import pytest
from dockerfile_parse import DockerfileParser

from serval.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(ROOT / "Dockerfile"))


def instructions(dockerfile: DockerfileParser, name: str) -> list[str]:
    return [item["value"] for item in dockerfile.structure if item["instruction"] == name]


def copies(dockerfile: DockerfileParser) -> list[tuple[list[str], str]]:
    """Each COPY's (sources, destination), its --flags dropped."""
    pairs = []
    for value in instructions(dockerfile, "COPY"):
        *sources, destination = [word for word in value.split() if not word.startswith("--")]
        pairs.append((sources, destination))
    return pairs


def test_every_copy_source_is_in_the_repository(dockerfile):
    pairs = copies(dockerfile)
    assert pairs, "the Dockerfile copies nothing"
    for sources, _ in pairs:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_it_copies_what_the_install_reads(dockerfile):
    copied = {source for sources, _ in copies(dockerfile) for source in sources}
    # pyproject's packages, its readme and license-files: pip install fails without any of them.
    assert {"pyproject.toml", "README.md", "LICENSE", "engine", "cluster", "deployments", "serval"} <= copied


def test_the_base_image_is_the_ray_version_serval_pins(dockerfile):
    pinned = re.search(r'"ray\[serve\]>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert dockerfile.baseimage.startswith(f"rayproject/ray:{pinned}-py311")


def test_the_install_is_the_serving_install(dockerfile):
    [run] = [value for value in instructions(dockerfile, "RUN") if "pip install" in value]
    assert "torch==2.13.0" in run
    assert re.search(r"pip install --no-cache-dir (-e )?\.( |$)", run), "Serval without extras (the serving set)"
    assert "[test]" not in run and "[bench]" not in run


def test_the_command_is_a_serval_command_over_a_file_the_image_holds(dockerfile):
    [cmd] = instructions(dockerfile, "CMD")
    argv = json.loads(cmd)  # the exec form: no shell between Docker and serval (signals reach it)
    assert argv[0] == "serval"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.host == "0.0.0.0" and not args.detach
    [workdir] = instructions(dockerfile, "WORKDIR")
    config = PurePosixPath(workdir) / args.config
    copied_to = {
        PurePosixPath(workdir) / destination: source
        for sources, destination in copies(dockerfile)
        for source in sources
        if len(sources) == 1
    }
    holder = next(dest for dest in copied_to if dest in config.parents)
    assert (ROOT / copied_to[holder] / config.relative_to(holder)).is_file()


def test_the_header_says_how_to_build_and_run_it(dockerfile):
    header = "\n".join(item["value"] for item in dockerfile.structure if item["instruction"] == "COMMENT")
    assert "docker build -t serval:" in header
    assert re.search(r"docker run --rm -p 8000:8000 .*serval:", header)
    assert "no container engine" in header

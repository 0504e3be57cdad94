"""The README and docs/ as a user reads them: the cheap parts run here, in seconds and without Ray.

* The README stays one screen (at most ``MAX_README_LINES`` lines).
* Every ``serval`` command the README names exists: ``serval <cmd> --help`` exits 0 (through the
  ``serval`` entry point, in a subprocess with ``PYTHONPATH`` the checkout; one interpreter for all of
  them), and every ``--flag`` the README and docs/ pass to it in a code block is one its ``--help`` lists.
* Every relative link in README.md and docs/*.md points to a file that exists, and a ``#fragment`` into a
  Markdown file to one of its headings (GitHub's anchors).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200
# `serval` subcommands with subcommands of their own (serval/cli.py's GROUP_HELP).
GROUPS = ("bench", "dashboard")
# The commands the README must name (a guard on the extraction below: it cannot find nothing and pass).
README_MUST_NAME = {"serve", "status", "stop", "fetch-model", "bench serve", "render-rayservice"}

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
# `serval` as a command word: not `serval.serve`, `serval/`, `serval_`, `.venv/bin/serval`'s path part or a quoted value
# (`ENGINES="serval llama"`).
COMMAND = re.compile(r"(?<![\w./\"=-])serval ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _command(match: re.Match) -> str:
    first, second = match.group(1), match.group(2)
    return f"{first} {second}" if first in GROUPS and second else first


def named_commands(text: str) -> set[str]:
    return {_command(m) for m in COMMAND.finditer(text)}


def code_lines(text: str) -> list[str]:
    """The shell lines of the fenced code blocks, continuation lines (``\\``) joined, comments dropped."""
    lines = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", "\n".join(block.splitlines()[1:-1]))
        lines += [line.split(" #")[0] for line in joined.splitlines()]
    return lines


def flags_passed(text: str) -> dict[str, set[str]]:
    """Command -> the flags code blocks pass to it (up to the end of its part of a pipeline or list)."""
    found: dict[str, set[str]] = {}
    for line in code_lines(text):
        for match in COMMAND.finditer(line):
            rest = re.split(r"\||&&|;|>", line[match.end() :])[0]
            found.setdefault(_command(match), set()).update(FLAG.findall(rest))
    return found


# Runs ``serval <command> --help`` for each command given (argv[1], JSON) through the ``serval`` entry point
# (serval.cli:main) in one interpreter, so the imports are paid once: {command: [exit code, its output]}.
HELP_SCRIPT = """
import contextlib, io, json, sys
from serval.cli import main
result = {}
for command in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main([*command.split(), "--help"])
        except SystemExit as exc:
            code = exc.code
    result[command] = [code, out.getvalue()]
print(json.dumps(result))
"""


def serval(*argv: str) -> subprocess.CompletedProcess:
    """A ``python`` run as a user's shell runs it from the checkout (``PYTHONPATH`` the repository)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def all_help(commands: set[str]) -> dict[str, str]:
    """Each command's ``--help`` text; fails the test naming every command whose ``--help`` did not exit 0."""
    run = serval("-c", HELP_SCRIPT, json.dumps(sorted(commands)))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    failed = {command: text[-500:] for command, (code, text) in result.items() if code not in (0, None)}
    assert not failed, f"serval <command> --help did not exit 0: {failed}"
    return {command: text for command, (_, text) in result.items()}


def test_readme_is_one_screen():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"


def test_every_serval_command_the_readme_names_exists():
    commands = named_commands(README.read_text(encoding="utf-8"))
    assert README_MUST_NAME <= commands, f"the README no longer names {sorted(README_MUST_NAME - commands)}"
    helps = all_help(commands)
    assert all(f"serval {c}" in text for c, text in helps.items())  # each usage line names its command
    entry_point = serval("-m", "serval", "serve", "--help")  # the console script's module, as `serval` runs it
    assert entry_point.returncode == 0 and "usage: serval serve" in entry_point.stdout, entry_point.stderr[-2000:]


def test_every_flag_in_the_docs_code_is_one_the_command_takes():
    wanted: dict[str, set[str]] = {}
    for path in (README, *DOCS):
        for command, flags in flags_passed(path.read_text(encoding="utf-8")).items():
            wanted.setdefault(command, set()).update(flags)
    helps = all_help(set(wanted))
    unknown = {c: sorted(f for f in flags if f not in FLAG.findall(helps[c])) for c, flags in wanted.items()}
    assert not {c: f for c, f in unknown.items() if f}, f"flags the commands do not take: {unknown}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z+.-]*:", t)]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(page: Path):
    broken = []
    for target in relative_links(page):
        file_part, _, fragment = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{target} (no heading #{fragment} in {destination.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_link_and_command_scanners_see_what_they_should(tmp_path: Path):
    sample = "Run `serval bench serve` or `serval stop`; [a](docs/x.md#y) [b](https://e.org) `[c](no.md)`\n"
    assert named_commands(sample) == {"bench serve", "stop"}
    assert named_commands("import_path: serval.serve:build_openai_app, .venv/bin/serval_x") == set()
    page = tmp_path / "page.md"
    page.write_text(sample + "![i](img/p.png)\n```\n[d](in-code.md)\n```\n")
    assert relative_links(page) == ["docs/x.md#y", "img/p.png"]
    assert github_anchor("Disaggregated prefill: `build_pd_openai_app`") == "disaggregated-prefill-build_pd_openai_app"
    assert github_anchor("Structured outputs (issue 18)") == "structured-outputs-issue-18"
    block = "```\nserval serve m --detach \\\n    --port 1 | tee x  # --not-a-flag\n```\n"
    assert flags_passed(block) == {"serve": {"--detach", "--port"}}

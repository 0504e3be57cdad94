"""Serve's logs on the terminal while ``serval serve`` runs in the foreground: the lines appended to the
session's ``logs/serve/*.log`` (the controller, the proxies, each replica, with request access lines), as
``serve run`` shows them. Only a head on this machine has its session directory here; for a remote
cluster the launcher says where they are instead.
"""

from __future__ import annotations

import sys
from pathlib import Path


class LogFollower:
    """The lines appended to ``directory``'s ``*.log`` files since it was made (files created later:
    from their first line)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.offsets = {path: path.stat().st_size for path in directory.glob("*.log")}
        self.partial: dict[Path, bytes] = {}

    def new_lines(self) -> list[str]:
        """The complete lines written since the last call, file by file."""
        lines = []
        for path in sorted(self.directory.glob("*.log")):
            try:
                with path.open("rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = self.partial.pop(path, b"") + f.read()
                    self.offsets[path] = f.tell()
            except OSError:
                continue
            *complete, rest = data.split(b"\n")
            if rest:
                self.partial[path] = rest
            lines += [line.decode(errors="replace") for line in complete]
        return lines

    def print_new(self, stream=sys.stdout) -> None:
        for line in self.new_lines():
            print(line, file=stream)
        stream.flush()

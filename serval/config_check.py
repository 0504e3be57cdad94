"""The check every command taking a Serve config runs before it starts or joins anything: the config as the
app builders will validate it (``deployments.serve_config``), its first problem refused in one line.

    serval serve: typo.yaml: applications[0].args.llm_configs[0].engine_kwargs.max_num_seq: unknown key; did you
    mean max_num_seqs?                                                      (one line, wrapped here)

Exit code ``REFUSED`` (2: the usage error's, as argparse's); ``serval --debug`` adds pydantic's full report.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

REFUSED = 2


def load_serve_config(text: str, source: str) -> Any:
    """The YAML ``text`` of ``source``; a YAML syntax error becomes a one-line ``ConfigError``."""
    import yaml

    from deployments.config_errors import ConfigError

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "the file"
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}: not YAML: {problem}") from None


def refuse(error: Exception, command: str, source: str | None, debug: bool) -> int:
    """Prints ``error`` (a ``ConfigError``) as its one line, after pydantic's report with ``debug``; ``REFUSED``."""
    details = getattr(error, "validation_error", None)
    if debug:
        traceback.print_exception(details or error)
    where = f"{source}: " if source else ""
    print(f"{command}: {where}{error}", file=sys.stderr)
    return REFUSED

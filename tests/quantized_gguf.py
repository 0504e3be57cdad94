"""The registry's .gguf file (``make models``) re-encoded by ``serval quantize-gguf``, each output made once a
test session: tests/serval/test_quantize_gguf.py checks the outputs' types and values and loads them, and
tests/engine/model/test_quantized_weights.py measures the Q8_0 output's perplexity, so one run of the tool
serves both modules (re-encoding the 135M model takes seconds per type).
"""

from __future__ import annotations

from pathlib import Path

from deployments.llm_config import SERVAL_ROOT

SOURCE = SERVAL_ROOT / "models" / "smollm2-135m-instruct.gguf"
_MADE: dict[tuple[str, ...], Path] = {}


def quantized_gguf(tmp_path_factory, *flags: str) -> Path:
    """The file ``serval quantize-gguf SOURCE OUT *flags`` writes (the command line, as a user runs it), under
    the session's temporary directory (``tmp_path_factory``); the same path for the same flags."""
    if flags not in _MADE or not _MADE[flags].is_file():  # made in this session's directory, still there
        from serval.cli import main as cli_main

        assert SOURCE.is_file(), "run `make models`"
        out = tmp_path_factory.mktemp("quantized") / "out.gguf"
        assert cli_main(["quantize-gguf", str(SOURCE), str(out), *flags]) == 0
        _MADE[flags] = out
    return _MADE[flags]

"""Where an offline engine's resident memory goes while it loads a GGUF file (issue 54's memory target:
a peak RSS of at most the file + the KV cache + 500 MB).

    python benchmarks/memory_breakdown.py [--model models/smollm2-135m-instruct.gguf] [--kv-mib 256]

Prints this process's RSS (and its peak so far, sampled every 5 ms) after each import, at every parse of
the file's metadata (each ``gguf.GGUFReader``, with who asked for it), at each of the engine's INFO lines,
once the ``LLM`` is built and after one 128 -> 32 generation; then the file's size and the KV cache's.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import traceback

import psutil

PROCESS = psutil.Process()
PEAK = [0.0]


def rss_mb() -> float:
    return PROCESS.memory_info().rss / 1e6


def sample_peak() -> None:
    while True:
        PEAK[0] = max(PEAK[0], rss_mb())
        time.sleep(0.005)


def mark(what: str) -> None:
    time.sleep(0.02)  # one more sample of the peak
    print(f"{rss_mb():7.0f} MB (peak {PEAK[0]:5.0f})  {what}", flush=True)


def caller(depth: int = 6) -> str:
    """The project's frames that led here, innermost first (site-packages' own left out)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "site-packages" not in f.filename][-depth:]
    return " < ".join(f"{os.path.relpath(f.filename)}:{f.lineno}" for f in reversed(frames))


def trace_metadata_parses() -> None:
    """Marks every ``gguf.GGUFReader`` built (ours and transformers'), with what it cost and who asked."""
    import gguf

    original = gguf.GGUFReader.__init__

    def init(self, *args, **kwargs):
        before = rss_mb()
        original(self, *args, **kwargs)
        mark(f"GGUFReader parsed (+{rss_mb() - before:.0f} MB) for {caller()}")

    gguf.GGUFReader.__init__ = init


class MarkEachLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        mark(f"log {record.name}: {record.getMessage()[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct.gguf")
    parser.add_argument("--kv-mib", type=int, default=256, help="kv_cache_memory_bytes, in MiB")
    args = parser.parse_args()
    threading.Thread(target=sample_peak, daemon=True).start()
    mark("python")
    import torch  # noqa: F401

    mark("import torch")
    import transformers  # noqa: F401

    mark("import transformers")
    from engine import LLM, SamplingParams

    mark("import engine")
    trace_metadata_parses()
    logging.getLogger("engine").addHandler(MarkEachLog())
    logging.getLogger("engine").setLevel(logging.INFO)
    llm = LLM(args.model, max_model_len=1024, kv_cache_memory_bytes=args.kv_mib << 20)
    mark("LLM built")
    prompt = {"prompt_token_ids": list(range(100, 228))}
    llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    mark("after one 128 -> 32 generation")
    file_mb = os.path.getsize(args.model) / 1e6
    kv_mb = (args.kv_mib << 20) / 1e6
    print(f"file {file_mb:.0f} MB + KV cache {kv_mb:.0f} MB + 500 MB = target peak {file_mb + kv_mb + 500:.0f} MB")


if __name__ == "__main__":
    main()

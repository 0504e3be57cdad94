"""``python -m benchmarks.gpu_check PHASE --work DIR [--smoke] [--deadline EPOCH_S] [--out DIR]``.

Runs one phase of the device check (benchmarks/gpu_check.sh runs each in its own process) and
writes its record to ``DIR/phases/PHASE.json``; ``report`` reads them all and writes ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from benchmarks.gpu_check.parity import run_parity_hf, run_parity_ours
from benchmarks.gpu_check.phases import (
    run_checkpoint,
    run_decode,
    run_hardware,
    run_kernels,
    run_prefill,
    write_record,
)
from benchmarks.gpu_check.quant import run_quant
from benchmarks.gpu_check.settings import get_settings

PHASES = {
    "hardware": run_hardware,
    "kernels": run_kernels,
    "checkpoint": run_checkpoint,
    "decode_graphs": lambda s, w, d: run_decode(s, w, d, eager=False),
    "decode_eager": lambda s, w, d: run_decode(s, w, d, eager=True),
    "prefill": run_prefill,
    "parity_ours": run_parity_ours,
    "parity_hf": run_parity_hf,
    "quant": run_quant,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    parser.add_argument("phase", choices=[*PHASES, "report"])
    parser.add_argument("--work", type=Path, required=True, help="checkpoint and phase records")
    parser.add_argument("--out", type=Path, help="report only: where results.json and table.md go")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny sizes")
    parser.add_argument(
        "--deadline",
        type=float,
        default=float("inf"),
        help="epoch seconds by which the phase should end (optional work is skipped)",
    )
    args = parser.parse_args(argv)
    settings = get_settings(args.smoke)
    # The engine's own progress (KV cache size, CUDA graph capture) in the log.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.phase == "report":
        from benchmarks.gpu_check.report import run_report

        return run_report(settings, args.work, args.out or args.work)
    begin = time.perf_counter()
    record = PHASES[args.phase](settings, args.work, args.deadline)
    record["phase_s"] = time.perf_counter() - begin
    write_record(args.work, args.phase, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Judges the phases' records against the targets: results.json, table.md, and the table on stdout.

Runs on the CPU only (no torch import): it must work even when every GPU phase failed.
Exit code: 0 when every phase ran and every judged target passed, 1 when a phase failed or timed
out, 2 when the phases ran but a target was missed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.gpu_check.quant import quant_rows
from benchmarks.gpu_check.rooflines import decode_roofline, prefill_roofline
from benchmarks.gpu_check.settings import (
    CUDA_GRAPH_MIN_GAIN,
    DECODE_B1_MIN_ROOFLINE_RATIO,
    KERNEL_BF16_REL_TOL,
    NEAR_TIE_LOGIT_GAP,
    Settings,
)

PASS, FAIL, INFO = "PASS", "FAIL", "info"


@dataclass
class Row:
    check: str
    measured: str
    roofline: str = ""
    ratio: str = ""
    target: str = ""
    verdict: str = INFO


# ---------------------------------------------------------------------------- inputs


def read_statuses(work: Path) -> dict[str, dict]:
    """``status.tsv`` (written by gpu_check.sh): phase, exit code (or 'skipped'), seconds, one line each."""
    statuses = {}
    path = work / "status.tsv"
    if path.is_file():
        for line in path.read_text().splitlines():
            phase, code, seconds = (line.split("\t") + ["", ""])[:3]
            statuses[phase] = {"rc": code, "seconds": float(seconds or 0)}
    return statuses


def phase_state(code: str) -> str:
    """'0' -> ok, '124'/'137' -> timed out, 'skipped:REASON' -> skipped (REASON), else failed."""
    if code.startswith("skipped"):
        return f"skipped ({code.partition(':')[2] or 'not run'})"
    return {"0": "ok", "124": "timed out", "137": "killed (timed out)"}.get(code, f"failed (exit {code})")


def read_records(work: Path) -> dict[str, dict]:
    records = {}
    for path in sorted((work / "phases").glob("*.json")):
        records[path.stem] = json.loads(path.read_text())
    return records


# ---------------------------------------------------------------------------- parity


def compare_parity(ours: dict, hf: dict, near_tie_gap: float = NEAR_TIE_LOGIT_GAP) -> dict:
    """Per prompt: how many tokens match transformers' greedy ones, and whether a divergence is a near-tie.

    A sequence may leave the reference only at a position where transformers' top-2 logits are within
    ``near_tie_gap`` (after that the contexts differ and nothing is compared). Logprobs of the chosen
    tokens are compared over the matched positions.
    """
    prompts = []
    for length, mine, reference in zip(ours["prompt_lens"], ours["tokens"], hf["references"]):
        expected = reference["tokens"]
        matched = next((i for i, (a, b) in enumerate(zip(mine, expected)) if a != b), min(len(mine), len(expected)))
        entry = {"prompt_len": length, "matched": matched, "of": len(expected)}
        if matched < len(expected):
            gap = reference["top2_gaps"][matched]
            entry.update(
                diverged_at=matched,
                ours=mine[matched],
                reference=expected[matched],
                top2_gap=gap,
                status="near-tie" if gap <= near_tie_gap else "mismatch",
            )
        else:
            entry["status"] = "exact"
        prompts.append(entry)
    logprob_diffs = [
        abs(a - b)
        for mine, ref, entry in zip(ours["logprobs"], hf["references"], prompts)
        for a, b in list(zip(mine, ref["logprobs"]))[: entry["matched"]]
    ]
    return {
        "near_tie_gap": near_tie_gap,
        "prompts": prompts,
        "max_abs_logprob_diff": max(logprob_diffs, default=0.0),
        "passed": all(p["status"] != "mismatch" for p in prompts),
    }


def parity_row(parity: dict) -> Row:
    prompts = parity["prompts"]
    exact = sum(p["status"] == "exact" for p in prompts)
    ties = [p for p in prompts if p["status"] == "near-tie"]
    mismatches = [p for p in prompts if p["status"] == "mismatch"]
    measured = f"{exact}/{len(prompts)} exact"
    if ties:
        measured += f", {len(ties)} near-tie (gap <= {max(p['top2_gap'] for p in ties):.2g})"
    if mismatches:
        measured += f", {len(mismatches)} MISMATCH (gap {min(p['top2_gap'] for p in mismatches):.2g})"
    measured += (
        f"; matched {','.join(str(p['matched']) for p in prompts)}; max abs dlogprob "
        f"{parity['max_abs_logprob_diff']:.1e}"
    )
    return Row(
        "greedy parity vs transformers (fp32)",
        measured,
        target=f"identical, or diverge at top-2 gap <= {parity['near_tie_gap']}",
        verdict=PASS if parity["passed"] else FAIL,
    )


# ----------------------------------------------------------------------------- rows


def _si(value: float, unit: str) -> str:
    """3 significant digits with an SI prefix: 4.31 T{unit}, 16.1 G{unit}, 140 k{unit}."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f} tok/s" if tokens_per_s >= 100 else f"{tokens_per_s:.1f} tok/s"


def _step(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms/step" if seconds >= 1e-4 else f"{seconds * 1e6:.2f} us/step"


def hardware_rows(hardware: dict) -> list[Row]:
    name = hardware["device_info"].get("name", "?")
    return [
        Row(f"copy bandwidth ({name})", f"{_si(hardware['copy_bytes_per_s'], 'B/s')} (read+write)"),
        Row(
            f"matmul {hardware['matmul_n']}^3 {hardware['matmul_dtype']}", _si(hardware["matmul_flops_per_s"], "FLOP/s")
        ),
    ]


def kernel_row(kernels: dict) -> Row:
    counts = ", ".join(f"{kernels[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if kernels.get(k))
    return Row(
        f"kernel tests ({', '.join(Path(f).name for f in kernels['files'])})",
        counts or "no tests",
        target=f"all pass (bf16 rel err <= {KERNEL_BF16_REL_TOL:g})",
        verdict=PASS if kernels["all_passed"] else FAIL,
    )


def decode_rows(decode: dict, hardware: dict | None, smoke: bool) -> list[Row]:
    rows = []
    for batch, result in decode["batches"].items():
        row = Row(
            f"decode {decode['dtype']} batch {batch}, {decode['mode']}",
            f"{_rate(result['tokens_per_s'])} ({_step(result['step_s'])})",
        )
        if hardware:
            roof = decode_roofline(
                decode["facts"],
                int(batch),
                result["prompt_len"],
                result["output_len"],
                decode["dtype"],
                hardware["copy_bytes_per_s"],
            )
            result["roofline"] = roof
            ratio = result["tokens_per_s"] / roof["tokens_per_s"]
            row.roofline = f"{_rate(roof['tokens_per_s'])} ({_step(roof['step_s'])})"
            row.ratio = f"{ratio:.2f}"
            if batch == "1" and decode["mode"] == "graphs":
                row.target = f">= {DECODE_B1_MIN_ROOFLINE_RATIO} of roofline"
                row.verdict = "n/a (smoke)" if smoke else (PASS if ratio >= DECODE_B1_MIN_ROOFLINE_RATIO else FAIL)
        rows.append(row)
    for batch in decode.get("skipped", []):
        rows.append(Row(f"decode batch {batch}, {decode['mode']}", "skipped (phase deadline)"))
    return rows


def graph_gain_rows(graphs: dict, eager: dict, smoke: bool) -> list[Row]:
    rows = []
    for batch, result in graphs["batches"].items():
        if batch not in eager["batches"]:
            continue
        gain = result["tokens_per_s"] / eager["batches"][batch]["tokens_per_s"]
        row = Row(
            f"CUDA graph gain, batch {batch}", f"{gain:.2f}x", f"eager {_rate(eager['batches'][batch]['tokens_per_s'])}"
        )
        if batch == "1":
            row.target = f">= {CUDA_GRAPH_MIN_GAIN}x"
            row.verdict = "n/a on CPU" if smoke else (PASS if gain >= CUDA_GRAPH_MIN_GAIN else FAIL)
        elif smoke:
            row.verdict = "n/a on CPU"
        rows.append(row)
    return rows


def prefill_row(prefill: dict, hardware: dict | None) -> Row:
    row = Row(
        f"prefill {prefill['dtype']} {prefill['num_prompts']}x{prefill['prompt_len']}", _rate(prefill["tokens_per_s"])
    )
    if hardware:
        roof = prefill_roofline(prefill["facts"], prefill["prompt_len"], hardware["matmul_flops_per_s"])
        prefill["roofline"] = roof
        row.roofline = f"{_rate(roof['tokens_per_s'])} ({_si(roof['flops_per_token'], 'FLOP')}/token)"
        row.ratio = f"{prefill['tokens_per_s'] / roof['tokens_per_s']:.2f}"
    return row


def checkpoint_row(checkpoint: dict) -> Row:
    return Row(
        "checkpoint (random, made here)",
        f"{_params(checkpoint['num_parameters'])} params, {_si(checkpoint['weight_bytes'], 'B')} "
        + (
            "(already there)"
            if checkpoint.get("reused")
            else f"in {checkpoint['make_s']:.0f} s ({checkpoint['threads']} threads)"
        ),
    )


def build_rows(records: dict, smoke: bool) -> tuple[list[Row], dict | None]:
    """The table's rows from whichever records exist; also the parity comparison, if both sides ran."""
    hardware = records.get("hardware")
    rows: list[Row] = []
    if hardware:
        rows += hardware_rows(hardware)
    if "kernels" in records:
        rows.append(kernel_row(records["kernels"]))
    if "checkpoint" in records:
        rows.append(checkpoint_row(records["checkpoint"]))
    parity = None
    if "parity_ours" in records and "parity_hf" in records:
        parity = compare_parity(records["parity_ours"], records["parity_hf"])
        rows.append(parity_row(parity))
    for mode in ("decode_graphs", "decode_eager"):
        if mode in records:
            rows += decode_rows(records[mode], hardware, smoke)
    if "decode_graphs" in records and "decode_eager" in records:
        rows += graph_gain_rows(records["decode_graphs"], records["decode_eager"], smoke)
    if "prefill" in records:
        rows.append(prefill_row(records["prefill"], hardware))
    if "quant" in records:
        rows += quant_rows(records["quant"], hardware)
    return rows, parity


# ---------------------------------------------------------------------------- output


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines)]

    def fmt(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines)])


def exit_code(statuses: dict, rows: list[Row]) -> int:
    if any(s["rc"] != "0" for s in statuses.values()):
        return 1
    return 2 if any(r.verdict == FAIL for r in rows) else 0


def run_report(settings: Settings, work: Path, out: Path) -> int:
    statuses = read_statuses(work)
    records = read_records(work)
    rows, parity = build_rows(records, settings.smoke)
    phase_lines = [[phase, phase_state(s["rc"]), f"{s['seconds']:.0f}"] for phase, s in statuses.items()]
    phases_md = markdown_table(["phase", "status", "s"], phase_lines)
    rows_md = markdown_table(
        ["check", "measured", "roofline", "ratio", "target", "verdict"], [list(asdict(r).values()) for r in rows]
    )
    title = (
        "gpu_check SMOKE run (CPU, tiny model, Triton interpreter: numbers are not meaningful, targets are for the GPU)"
        if settings.smoke
        else "gpu_check"
    )
    code = exit_code(statuses, rows)
    text = f"## {title}\n\n{phases_md}\n\n{rows_md}\n\nexit code {code}\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    results = {
        "smoke": settings.smoke,
        "exit_code": code,
        "settings": asdict(settings),
        "phases": {p: {**s, "state": phase_state(s["rc"])} for p, s in statuses.items()},
        "rows": [asdict(r) for r in rows],
        "parity": parity,
        "records": records,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + text, flush=True)
    return code

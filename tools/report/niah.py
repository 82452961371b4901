"""The tables of docs/results/niah.md, needle in a haystack (DapQ's own benchmark): retrieval accuracy per method,
budget, haystack and length beside the paper's, the reach of PASK's floors, the pooling probe, and the dev grid of
query-ranked floors on long BFCL prompts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from tools.report.common import _block, _table, load_json
from tools.report.frozen import Tuning, dev_tuning

# DapQ's paper, NIAH on LLaMA-3-8B-Instruct at 8k tokens with 256 kept (about 3%): accuracy in %.
NIAH_PAPER_3PCT = {"dapq": 99.46, "snapkv": 90.97, "pyramidkv": 93.94, "h2o": 66.81}
NIAH_FILE = "results/niah_qwen2.5-coder-0.5b.json"


def niah_qwen05b(root: Path, file: str = NIAH_FILE) -> str:
    """Needle retrieval accuracy per (method, budget) and (haystack, length), JSON answers, beside the paper's 3%."""
    result = load_json(root, file)
    summary = [s for s in result["summary"] if s["mode"] == "json"]
    places = sorted({(s["haystack"], s["length"]) for s in summary}, key=lambda p: (p[1], p[0]))
    depths = {p: sorted({c["depth"] for c in result["cells"] if (c["haystack"], c["length"]) == p}) for p in places}
    smallest = min(s["budget"] for s in summary if s["method"] != "full")
    rows, at_smallest = [], []
    for method, budget in dict.fromkeys((s["method"], s["budget"]) for s in summary):
        mine = {(s["haystack"], s["length"]): s for s in summary if (s["method"], s["budget"]) == (method, budget)}
        cells = [f"{100 * mine[p]['accuracy']:.0f}" if p in mine else "-" for p in places]
        paper = NIAH_PAPER_3PCT.get(method) if budget == 0.03 else None
        kept = sum(s["kept_ratio_mean"] for s in mine.values()) / len(mine)
        rows.append([method, f"{budget:g}", *cells, f"{kept:.3f}", "-" if paper is None else f"{paper:.2f}"])
        if budget in (smallest, 1.0):
            correct, n = sum(s["correct"] for s in mine.values()), sum(s["n"] for s in mine.values())
            at_smallest.append(f"{method} {correct}/{n}")
    counts = {place: len(depths[place]) for place in places}
    head = ["method", "b", *(f"{h} {n // 1024}k ({counts[h, n]} depth{'s' * (counts[h, n] > 1)})" for h, n in places)]
    head.append("kept/full")
    claim = (
        f"{result['model']}, JSON-constrained answers: needles found at b = {smallest:g} (full KV at b = 1), of all "
        "cells: " + ", ".join(at_smallest) + "."
    )
    return _block(claim, _table([*head, "paper, 8k at 3% (LLaMA-3-8B)"], rows))


def niah_floor_reach(root: Path, file: str = "results/niah_floor_reach_dev.json") -> str:
    """Per budget and layer group: how many prompt entries PASK's floors protect against what a layer keeps, and at
    which depths the needle is among them (`scripts/niah_floor_reach.py`, roles only)."""
    result = load_json(root, file)
    rows, parts = [], []
    for budget, group in dict.fromkeys((r["budget"], r["group"]) for r in result["rows"]):
        mine = [r for r in result["rows"] if (r["budget"], r["group"]) == (budget, group)]
        ratio = sum(r["protected"] / r["kept_per_layer"] for r in mine) / len(mine)
        reached = [r for r in mine if r["needle_protected"]]
        depths = ", ".join(f"{d:g}" for d in sorted({r["depth"] for r in reached})) or "none"
        rows.append([f"{budget:g}", group, f"{ratio:.2f}", f"{len(reached)}/{len(mine)}", depths])
        if group and budget == min(r["budget"] for r in result["rows"]):
            parts.append(f"group {group} {ratio:.1f}x")
    lengths = sorted({r["length"] for r in result["rows"]})
    claim = (
        f"Dev needle prompts (seed {result['seed']}, {', '.join(f'{n // 1024}k' for n in lengths)}, both haystacks), "
        f"the policy {result['policy']}: at b = {min(r['budget'] for r in result['rows']):g} the floors protect "
        + ", ".join(parts)
        + " the entries a layer keeps."
    )
    head = ["b", "layer group", "protected / kept per layer", "needle protected", "at depths"]
    return _block(claim, _table(head, rows))


def leading_digits_right(number: str, read: str | None) -> int:
    """How many digits of the needle's number the answer gets right before its first wrong one."""
    return next(
        (i for i, (a, b) in enumerate(zip(number, read or "", strict=False)) if a != b),
        min(len(number), len(read or "")),
    )


def niah_pooling_probe(root: Path) -> str:
    """DapQ and SnapKV with and without pooling their scores along the keys: needles found and leading digits right."""
    result = load_json(root, "results/niah_probe/niah_pooling_2k.json")
    cells = [c for c in result["cells"] if c["mode"] == "json"]
    rows, found = [], []
    for method, budget in dict.fromkeys((c["method"], c["budget"]) for c in cells):
        mine = [c for c in cells if (c["method"], c["budget"]) == (method, budget)]
        digits = sum(leading_digits_right(c["number"], c["read"]) for c in mine) / len(mine)
        correct = sum(c["correct"] for c in mine)
        rows.append([method, f"{budget:g}", f"{correct}/{len(mine)}", f"{digits:.1f}"])
        found.append(f"{method} b = {budget:g} {correct}/{len(mine)} ({digits:.1f} digits)")
    claim = (
        f"{result['model']}, 2k tokens, JSON answers; needles found and the mean count of leading digits right (of 7): "
        + ", ".join(found)
        + "."
    )
    return _block(claim, _table(["method", "b", "needles found", "leading digits right (of 7)"], rows))


QUERY_FLOORS_LONG = Tuning(  # PASK's default against query-ranked floors on the long dev prompts (main's code)
    (
        "results/dev_v2/bfcl_dev_long2k_query_floors_question_last.json",
        "results/dev_v2/bfcl_dev_long2k_query_floors_question_first.json",
    ),
    0.2,
)

TABLES: dict[str, Callable[[Path], str]] = {
    "niah_qwen05b": niah_qwen05b,
    "niah_16k": functools.partial(niah_qwen05b, file="results/niah_16k_qwen2.5-coder-0.5b.json"),
    "niah_32k": functools.partial(niah_qwen05b, file="results/niah_32k_qwen2.5-coder-0.5b.json"),
    "niah_4k8k_shipped": functools.partial(niah_qwen05b, file="results/niah_4k8k_shipped_qwen2.5-coder-0.5b.json"),
    "niah_pooling_probe": niah_pooling_probe,
    "niah_floor_reach_dev": niah_floor_reach,
    "niah_dev_query_floors": functools.partial(niah_qwen05b, file="results/dev_v2/niah_dev_seed1_4k_query_floors.json"),
    "dev_query_floors_long2k": functools.partial(dev_tuning, tuning=QUERY_FLOORS_LONG),
}

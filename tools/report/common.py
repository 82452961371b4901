"""What the documents' modules share: reading the committed results files (``ReportError`` where a table cannot be
rendered from them), the numbers read from them, and formatting a table block (a claim sentence, then Markdown
tables)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from pask_jax.experiments import bfcl

BUDGETS = (0.2, 0.33, 0.5)
OWN16_STATS = "results/calibration_qwen2.5-coder-0.5b_own16.json"  # the item-hash policy sections 2-5 scored
ITEM_HASH_CALIBRATIONS = (  # calibrated on the item-hash split's calibration part (sections 2-5 use them)
    "results/calibration_qwen2.5-coder-0.5b_8items.json",
    "results/calibration_qwen2.5-coder-0.5b_own16.json",
    "results/calibration_qwen2.5-coder-0.5b_own31.json",
)


class ReportError(ValueError):
    """A results document or results file that the tables cannot be rendered from."""


# ---- reading results ------------------------------------------------------------------------------------------------


def load_json(root: Path, relative: str) -> dict:
    path = root / relative
    if not path.is_file():
        raise ReportError(f"results file {relative} is missing under {root}")
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and data.get("partial"):  # `pask-jax bfcl` interrupted: a table would miss its batches
        raise ReportError(f"results file {relative} has {data['partial']['category']} under way: finish its run first")
    return data


def _runs(result: dict, method: str, budget: float, categories: Sequence[str] | None = None) -> list[dict]:
    runs = [
        r
        for r in result["runs"]
        if r["method"] == method
        and math.isclose(r["budget"], budget)
        and (categories is None or r["category"] in categories)
    ]
    if not runs:
        raise ReportError(f"no run of {method} at b = {budget:g} in this result")
    return runs


def items_of(result: dict, method: str, budget: float, categories: Sequence[str] | None = None) -> list[dict]:
    """The scored items of one (method, budget) of a `pask-jax bfcl` result, in the file's order."""
    return [item for run in _runs(result, method, budget, categories) for item in run["items"]]


def outcomes(result: dict, method: str, budget: float, categories: Sequence[str] | None = None) -> dict[str, bool]:
    """item id -> correct, for one (method, budget), in the file's order."""
    return {item["id"]: bool(item["valid"]) for item in items_of(result, method, budget, categories)}


def category_scores(result: dict, method: str, budget: float) -> dict[str, tuple[int, int]]:
    """category -> (correct, n) of one (method, budget), counted from the items (summed over runs of one category)."""
    scores: dict[str, tuple[int, int]] = {}
    for r in _runs(result, method, budget):
        correct, n = scores.get(r["category"], (0, 0))
        scores[r["category"]] = (correct + sum(bool(i["valid"]) for i in r["items"]), n + len(r["items"]))
    return scores


def overall(result: dict, method: str, budget: float) -> float | None:
    """BFCL's overall mean (the unweighted mean of the 8 category accuracies)."""
    return bfcl.summarize(category_scores(result, method, budget))["overall"]


def _keys(result: dict) -> list[tuple[str, float]]:
    return list(dict.fromkeys((r["method"], r["budget"]) for r in result["runs"]))


# ---- formatting -----------------------------------------------------------------------------------------------------


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def _points(x: float) -> str:
    return f"{100 * x:+.1f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}x"


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _block(claim: str, *tables: str) -> str:
    return "\n\n".join([f"**Claim.** {claim}", *tables])

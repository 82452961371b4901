"""The tuning protocol: every method's variant is chosen on dev items by one rule, before evaluation items are scored.

A dev result (`pask-jax bfcl --split dev`) holds, side by side on the same items and the same shared prefills, each
method's default (`snapkv`) and its labelled variants (`snapkv:w8max`, ...). For every method the variant with the
most correct dev items is chosen; a tie goes to the default if it is among the tied, else to the variant listed
first (the grid's order). PASK's variants (its compiler options as labelled policies, its online options as config
sections) go through the same rule as every baseline's.
"""

from __future__ import annotations

import math


def method_of(spec: str) -> str:
    """`snapkv:w8max` -> `snapkv`."""
    return spec.partition(":")[0]


def dev_totals(result: dict, budget: float) -> dict[str, tuple[int, int]]:
    """spec -> (correct, items) over every category of a dev result at `budget` (full KV at 1), in the file's order."""
    if result.get("config", {}).get("split") != "dev":
        raise ValueError("variants are chosen on a dev result (`pask-jax bfcl --split dev`) only")
    totals: dict[str, list[int]] = {}
    for run in result["runs"]:
        if math.isclose(run["budget"], budget) or run["method"] == "full":
            total = totals.setdefault(run["method"], [0, 0])
            total[0] += sum(bool(i["valid"]) for i in run["items"])
            total[1] += len(run["items"])
    sizes = {n for _, n in totals.values()}
    if len(sizes) > 1:
        raise ValueError(f"the variants were scored on different numbers of dev items: {sorted(sizes)}")
    return {spec: (c, n) for spec, (c, n) in totals.items()}


def choose_variants(result: dict, budget: float) -> dict[str, str]:
    """method -> the chosen spec, by the rule above (full KV has no variants)."""
    totals = dev_totals(result, budget)
    chosen: dict[str, str] = {}
    for spec, (correct, _) in totals.items():
        method = method_of(spec)
        if method == "full":
            continue
        best = chosen.get(method)
        if best is None:
            chosen[method] = spec
            continue
        best_correct = totals[best][0]
        if correct > best_correct or (correct == best_correct and spec == method):
            chosen[method] = spec
    return chosen

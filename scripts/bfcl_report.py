"""Markdown report of `pask-jax bfcl` results: accuracy per category and the three means, kept/full KV, and where
the errors come from (bfcl-eval's error types, and how many runs hit the token limit), per (method, budget), and
which of full KV's correct calls each compressed run loses (and which of full KV's errors it gets right).

    python scripts/bfcl_report.py results/bfcl_sweep_limit8.json [more.json ...] [--budget 0.33]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from pask_jax.experiments.bfcl.evaluate import format_table, item_stats, summarize_runs


def kept_table(runs: list[dict]) -> str:
    lines = ["| method | budget | kept/full mean | kept/full max | truncated at max tokens |", "|---|---|---|---|---|"]
    for key in dict.fromkeys((r["method"], r["budget"]) for r in runs):
        group = [r for r in runs if (r["method"], r["budget"]) == key]
        items = [i for r in group for i in r["items"]]
        stats = item_stats(items)
        truncated = sum(i.get("finish_reason") == "length" for i in items)
        lines.append(
            f"| {key[0]} | {key[1]:g} | {stats['kept_ratio_mean']:.3f} | {stats['kept_ratio_max']:.3f} | "
            f"{truncated}/{len(items)} |"
        )
    return "\n".join(lines)


def error_table(runs: list[dict], budget: float | None) -> str:
    """Error types of the wrong items, per (method, budget); categories where full KV is right too are not split."""
    counts: dict[tuple, Counter] = {}
    for r in runs:
        if budget is not None and r["budget"] not in (budget, 1.0):
            continue
        counter = counts.setdefault((r["method"], r["budget"]), Counter())
        counter.update(i["error_type"] or "none" for i in r["items"] if not i["valid"])
    kinds = sorted({k for c in counts.values() for k in c}, key=lambda k: -sum(c[k] for c in counts.values()))
    lines = ["| method | budget | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for (method, b), c in counts.items():
        lines.append(f"| {method} | {b:g} | " + " | ".join(str(c[k]) for k in kinds) + " |")
    return "\n".join(lines)


def versus_full_table(runs: list[dict], budget: float | None) -> str:
    """Per (method, budget): items full KV gets right and the method wrong (lost, by error type), and the reverse."""
    full = {i["id"]: i["valid"] for r in runs if r["method"] == "full" for i in r["items"]}
    if not full:
        return "(no full KV run to compare with)"
    lines = ["| method | budget | lost | gained | lost by error type |", "|---|---|---|---|---|"]
    for key in dict.fromkeys((r["method"], r["budget"]) for r in runs if r["method"] != "full"):
        if budget is not None and key[1] != budget:
            continue
        items = [i for r in runs if (r["method"], r["budget"]) == key for i in r["items"] if i["id"] in full]
        lost = [i for i in items if full[i["id"]] and not i["valid"]]
        gained = sum(i["valid"] and not full[i["id"]] for i in items)
        kinds = Counter(i["error_type"] or "none" for i in lost).most_common()
        lines.append(
            f"| {key[0]} | {key[1]:g} | {len(lost)}/{len(items)} | {gained} | "
            + ", ".join(f"{k} {n}" for k, n in kinds)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--budget", type=float, help="error breakdown at this budget only (and full KV)")
    args = parser.parse_args()
    runs = [r for path in args.results for r in json.loads(path.read_text())["runs"]]
    result = {"runs": runs, "summary": summarize_runs(runs)}
    categories = list(dict.fromkeys(r["category"] for r in runs))
    print("### Accuracy (%)\n\n" + format_table(result, categories))
    print("\n### KV kept\n\n" + kept_table(runs))
    print("\n### Errors of the wrong items (bfcl-eval error types)\n\n" + error_table(runs, args.budget))
    print("\n### Against full KV (same items)\n\n" + versus_full_table(runs, args.budget))


if __name__ == "__main__":
    main()

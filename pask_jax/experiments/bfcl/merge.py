"""Merge `pask-jax bfcl` results over disjoint item ranges (e.g. `--offset 0 --limit 8` and `--offset 8 --limit 17`)
into one result, as if run at once: items concatenated per (method, budget, category), counts and means recomputed.
With `replace`, a later result's items replace an earlier result's items of the same id (a rerun after a fix).
`load("PATH#OLD=NEW")` renames method OLD in that file (two PASK policies that both ran as `pask`, side by side).
`scripts/merge_bfcl.py` is the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

from pask_jax.experiments.bfcl.evaluate import item_stats, summarize_runs


def merge(results: list[dict], methods: set[str] | None = None, replace: bool = False) -> dict:
    """Runs of the same (method, budget, category) are joined; an item id seen twice is an error, or with `replace`
    the later result's item wins."""
    if len({r["model"] for r in results}) != 1:
        raise ValueError("results are for different models")
    if under_way := [r["partial"]["category"] for r in results if r.get("partial")]:
        raise ValueError(f"a result has {under_way[0]} under way (interrupted): rerun its command to finish it first")
    joined: dict[tuple, dict] = {}
    for result in results:
        for run in result["runs"]:
            if methods is not None and run["method"] not in methods:
                continue
            key = (run["method"], run["budget"], run["category"])
            if key not in joined:
                joined[key] = {**run, "items": list(run["items"]), "wall_s": run["wall_s"], "_steps": [run]}
                continue
            merged = joined[key]
            seen = {item["id"] for item in merged["items"]}
            twice = seen & {item["id"] for item in run["items"]}
            if twice and not replace:
                raise ValueError(f"{key}: items {sorted(twice)[:3]} appear in more than one result")
            if twice:  # whole earlier parts give way, so steps and wall time stay exact
                kept = [p for p in merged["_steps"] if not {item["id"] for item in p["items"]} & twice]
                if sum(len(p["items"]) for p in kept) + len(twice) != len(seen):
                    raise ValueError(f"{key}: --replace needs the rerun to cover whole earlier results")
                merged |= {
                    "items": [item for p in kept for item in p["items"]],
                    "wall_s": sum(p["wall_s"] for p in kept),
                    "_steps": kept,
                }
            merged["items"] += run["items"]
            merged["wall_s"] = round(merged["wall_s"] + run["wall_s"], 1)
            merged["_steps"].append(run)
    runs = []
    for run in joined.values():
        items, parts = run["items"], run.pop("_steps")
        steps = sum(p["decode_steps"] for p in parts)
        run |= item_stats(items) | {
            "decode_steps": steps,
            # step-weighted, as each part's fraction is over its own steps
            "parser_seconds_per_step_fraction": sum(
                p["parser_seconds_per_step_fraction"] * p["decode_steps"] for p in parts
            )
            / max(steps, 1),
        }
        runs.append(run)
    config = results[0]["config"] | {"merged_from": [r["config"] for r in results]}
    # each method's settings as the result that ran it recorded them (a section another result lacks, or set
    # differently for a method it did not run, must not change what a row reports)
    ran_by = {run["method"]: r["config"] for r in results for run in r["runs"]}
    config["method_config"] = {
        section: values
        for spec, source in ran_by.items()
        for section, values in source.get("method_config", {}).items()
        if section in (spec, spec.partition(":")[0])
    }
    config["policies"] = {k: v for r in results for k, v in r["config"].get("policies", {}).items()}
    return {"model": results[0]["model"], "config": config, "runs": runs, "summary": summarize_runs(runs)}


def load(arg: str) -> dict:
    """`PATH` or `PATH#OLD=NEW[#OLD=NEW...]`: a result file, its methods renamed."""
    path, *renames = arg.split("#")
    result = json.loads(Path(path).read_text())
    for rename in renames:
        old, sep, new = rename.partition("=")
        if not sep or not any(run["method"] == old for run in result["runs"]):
            raise ValueError(f"{arg}: {rename!r} must be OLD=NEW with OLD a method of {path}")
        for run in result["runs"]:
            run["method"] = new if run["method"] == old else run["method"]
    return result

"""The tables of docs/results/bfcl.md, the schema split: the frozen evaluation at several budgets, the first PASK on
both models, PASK v2's short-prompt samples, parallel calls on dev items, and the calibration statistics with the
shipped policy."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from pask_jax.experiments import bfcl
from tools.report.common import (
    BUDGETS,
    ITEM_HASH_CALIBRATIONS,
    OWN16_STATS,
    _block,
    _table,
    category_scores,
    load_json,
    outcomes,
)
from tools.report.frozen import (
    SCHEMA_EVAL,
    SCHEMA_EVAL_1_5B,
    SHORT_V2_TUNING,
    _best_tuned,
    _eval_row,
    _frozen_eval,
    _scored_budgets,
    _shown_specs,
    dev_tuning,
    long_prompts,
    schema_eval,
    schema_paired,
)
from tools.report.stats import _paired_row

SCHEMA_EVAL_BUDGETS = "results/bfcl_schema_eval_budgets.json"  # the same, b = 0.2 / 0.33 / 0.5
SCHEMA_EVAL_B02 = "results/bfcl_schema_eval_b02_b033.json"  # the same, b = 0.2 and 0.33, four categories


def readme_headline(root: Path, files: Sequence[str] = (SCHEMA_EVAL, SCHEMA_EVAL_1_5B)) -> str:
    """The first PASK on both models: each model's frozen evaluation (`schema_eval`) side by side, as the mean over the
    full-KV-positive categories per method, then PASK paired against its model's best tuned baseline and full KV."""
    evals = [_frozen_eval(root, file) for file in files]
    models = [result["model"] for result, _, _ in evals]
    cells: dict[tuple[str, str], list[str]] = {}
    order: list[tuple[str, str]] = []
    paired: dict[str, list[str]] = {"best": [], "full": []}
    parts = []
    for k, (result, chosen, positive) in enumerate(evals):
        (budget,) = _scored_budgets(result, chosen["pask"])
        specs = [("full", 1.0)] + [(s, budget) for s in _shown_specs(result, chosen, budget)]
        for spec, b in specs:
            key = (spec, f"{b:g}")
            if key not in cells:
                order.append(key)
                cells[key] = ["-"] * len(evals)
            cells[key][k] = _eval_row(result, spec, b, positive, [])[-2]
        best = _best_tuned(result, chosen, budget, positive)
        pask = outcomes(result, chosen["pask"], budget, positive)
        for name, other in (
            ("best", outcomes(result, best, budget, positive)),
            ("full", outcomes(result, "full", 1.0, positive)),
        ):
            row = _paired_row("", pask, other)
            paired[name].append(f"{row[6]}, p = {row[7]}")
        parts.append(
            f"{result['model']} PASK {cells[(chosen['pask'], f'{budget:g}')][k]}, full KV {cells[('full', '1')][k]}, "
            f"best tuned baseline {best} {cells[(best, f'{budget:g}')][k]}"
        )
    first, first_chosen, _ = evals[0]
    head_budget = f"{_scored_budgets(first, first_chosen['pask'])[0]:g}"
    pinned = [("full", "1"), (first_chosen["pask"], head_budget)]  # then the baselines by the first model's score
    first_score = {key: float(cells[key][0]) if cells[key][0] != "-" else 0.0 for key in order}
    rest = sorted((key for key in order if key not in pinned), key=lambda key: -first_score[key])
    rows = [[spec, b, *cells[(spec, b)]] for spec, b in pinned + rest]
    rows.append(["PASK - best tuned baseline", head_budget, *paired["best"]])
    rows.append(["PASK - full KV", head_budget, *paired["full"]])
    items = sum(n for _, n in category_scores(first, "full", 1.0).values())
    claim = (
        f"BFCL, schema split, {items} evaluation items ({', '.join(evals[0][2])}), frozen methods, b = {head_budget}: "
        + "; ".join(parts)
        + "."
    )
    return _block(claim, _table(["method", "b", *models], rows))


# ---- parallel calls on dev items ------------------------------------------------------------------------------------

PARALLEL_DEV = "results/parallel_dev"
PARALLEL_CATEGORIES = tuple(c for c in bfcl.CATEGORIES if "parallel" in c)
PARALLEL_FRAMINGS = (  # (model, prompt, framing): the framings tried, in order
    ("qwen2.5-coder-0.5b", "bfcl", "tool_call"),
    ("qwen2.5-coder-0.5b", "bfcl_parallel", "tool_call"),
    ("qwen2.5-coder-0.5b", "template", "tool_call"),
    ("qwen2.5-coder-0.5b", "bfcl_parallel", "json_fence"),
    ("qwen2.5-coder-1.5b", "bfcl_parallel", "tool_call"),
    ("qwen2.5-coder-1.5b", "template", "tool_call"),
)


def _calls_written(text: str) -> int:
    return max(text.count("<tool_call>"), text.count('{"name"'))


def parallel_dev(root: Path) -> str:
    """Full KV on the parallel categories' dev items under each prompt framing: correct items, items with two or
    more calls."""
    head = ["model", "prompt", "framing", *PARALLEL_CATEGORIES, "all", "answers with 2+ calls"]
    rows, best = [], 0
    for model, prompt, framing in PARALLEL_FRAMINGS:
        suffix = "" if framing == "tool_call" else f"_{framing}"
        result = load_json(root, f"{PARALLEL_DEV}/{model}_{prompt}{suffix}.json")
        runs = {r["category"]: r for r in result["runs"] if r["method"] == "full"}
        items = [i for c in PARALLEL_CATEGORIES for i in runs[c]["items"]]
        correct = sum(runs[c]["correct"] for c in PARALLEL_CATEGORIES)
        best = max(best, correct)
        several = sum(_calls_written(i["text"]) >= 2 for i in items)
        cells = [f"{runs[c]['correct']}/{runs[c]['n']}" for c in PARALLEL_CATEGORIES]
        rows.append([model, prompt, framing, *cells, f"{correct}/{len(items)}", several])
    claim = (
        f"Full KV on the parallel categories' dev items: at most {best} correct under any of {len(rows)} prompt "
        "framings and models."
    )
    return _block(claim, _table(head, rows))


# ---- calibration ----------------------------------------------------------------------------------------------------

SHIPPED_POLICY = "pask_jax/policies/qwen2.5-coder-0.5b"
SCHEMA_CALIBRATIONS = (  # the schema split's calibration part
    "results/calibration_qwen2.5-coder-0.5b_schema36.json",
    "results/calibration_qwen2.5-coder-1.5b_schema12.json",
)
POLICY_ROOTS = ("pask_jax/policies", "results/policies")


def _policies_from(root: Path, stats_file: str) -> list[str]:
    """Policy directories whose recorded compile command reads `stats_file`."""
    name = Path(stats_file).name
    found = []
    for base in POLICY_ROOTS:
        for meta in sorted((root / base).rglob("policy.json")):
            if f"--stats results/{name} " in json.loads(meta.read_text(encoding="utf-8"))["notes"] + " ":
                found.append(str(meta.parent.relative_to(root)))
    return found


def calibration_stats(root: Path) -> str:
    rows = []
    for file in ITEM_HASH_CALIBRATIONS + SCHEMA_CALIBRATIONS:
        stats = load_json(root, file)
        n = stats["n_items"]
        rows.append(
            [
                f"`{Path(file).name}`",
                n,
                stats.get("target", "canonical"),
                ", ".join(f"{x:g}" for x in stats["levels"]),
                f"{stats['baseline_error']:.2f}",
                f"{stats['wall_s']:,.0f}",
                f"{stats['wall_s'] / n:.0f}",
                ", ".join(f"`{p}`" for p in _policies_from(root, file)) or "none",
            ]
        )
    claim = (
        "Calibration statistics: " + "; ".join(f"{r[1]} items against the {r[2]} call in {r[5]} s" for r in rows) + "."
    )
    head = [
        "file",
        "items",
        "target",
        "keep levels",
        "baseline task error",
        "wall s",
        "s / item",
        "policies compiled from it",
    ]
    return _block(claim, _table(head, rows))


def calibration_own16_task_error(root: Path) -> str:
    """Task-error increase with the bucket removed (keep level 0), per role present and layer group."""
    from pask_jax.structure.roles import role_names, taxonomy_roles

    stats = load_json(root, OWN16_STATS)
    names = role_names()[: taxonomy_roles(stats["taxonomy"])]  # the roles of the taxonomy it was measured in
    rows = [
        [names[r], *(f"{g[0]:.2f}" for g in stats["task_error"][r]), f"{stats['entries'][r][0]:.1f}"]
        for r in range(len(names))
        if max(stats["present"][r]) > 0
    ]
    groups = range(stats["groups"])
    worst = max(rows, key=lambda row: max(float(x) for x in row[1:-1]))
    claim = (
        f"One changed call of the {stats['n_items']} items is {1 / stats['n_items']:.2f} of task error; removing a "
        f"bucket changes the call most for {worst[0]} ({' / '.join(worst[1:-1])} in groups "
        + " / ".join(str(g) for g in groups)
        + ")."
    )
    head = ["role", *(f"group {g}" for g in groups), "entries per item"]
    return _block(claim, _table(head, rows))


def shipped_policy(root: Path) -> str:
    """The shipped policy's kept fraction per layer group at every budget, and its floors at b = 0.33."""
    policy = load_json(root, f"{SHIPPED_POLICY}/policy.json")
    groups = range(policy["groups"])
    fractions = [[f"{t['budget']:g}", *(f"{f:.2f}" for f in t["group_fractions"])] for t in policy["tables"]]
    table = next(t for t in policy["tables"] if math.isclose(t["budget"], 0.33))
    floors = [
        [role, *(f"{f:.2f}" for f in b["floor"]), " / ".join(b["action"])]
        for role, b in table["buckets"].items()
        if max(b["floor"]) > 0
    ]
    claim = (
        f"The shipped policy ({len(policy['calibration_items'])} calibration items, {policy['groups']} layer groups) "
        "keeps per layer group at b = 0.33: " + " / ".join(fractions[BUDGETS.index(0.33)][1:]) + " of the full length."
    )
    return _block(
        claim,
        _table(["b", *(f"group {g}" for g in groups)], fractions),
        _table(["role with a floor (b = 0.33)", *(f"floor, group {g}" for g in groups), "action"], floors),
    )


TABLES: dict[str, Callable[[Path], str]] = {
    "calibration_stats": calibration_stats,
    "calibration_own16_task_error": calibration_own16_task_error,
    "shipped_policy": shipped_policy,
    "dev_tuning_b033": dev_tuning,
    "schema_eval": schema_eval,
    "schema_paired": schema_paired,
    "schema_eval_budgets": functools.partial(schema_eval, file=SCHEMA_EVAL_BUDGETS),
    "schema_paired_budgets": functools.partial(schema_paired, file=SCHEMA_EVAL_BUDGETS),
    "schema_eval_b02_b033": functools.partial(schema_eval, file=SCHEMA_EVAL_B02),
    "schema_paired_b02_b033": functools.partial(schema_paired, file=SCHEMA_EVAL_B02),
    "readme_headline": readme_headline,
    **{
        f"short_prompts_v2{part}": functools.partial(
            long_prompts, file=f"results/short_v2/bfcl_short_v2{part}.json", tuning=SHORT_V2_TUNING
        )
        for part in ("", "_items0_24", "_pooled", "_items85_109", "_pooled_all")
    },
    "parallel_dev": parallel_dev,
}

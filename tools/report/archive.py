"""The tables of docs/results/archive.md, the item-hash split: BFCL accuracy against budget on the default evaluation
sample, the split's overlap with the calibration items, paired comparisons, errors against full KV, PASK's ablations
and the policy compiler's options on dev items."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from pask_jax.experiments import bfcl
from tools.report.common import (
    BUDGETS,
    ITEM_HASH_CALIBRATIONS,
    OWN16_STATS,
    ReportError,
    _block,
    _keys,
    _pct,
    _points,
    _table,
    category_scores,
    items_of,
    load_json,
    outcomes,
    overall,
)
from tools.report.stats import PAIRED_HEAD, _paired_row, mcnemar_exact_p, paired_counts

BASELINES = ("random", "streamingllm", "h2o", "snapkv", "pyramidkv", "dapq")
NON_PARALLEL = ("simple_python", "multiple", "live_simple", "live_multiple")
SWEEP = "results/bfcl_sweep_25.json"
SWEEP_PASK = ("results/bfcl_pask_entry_order.json", "results/bfcl_pask_entry_order_parallel.json")


# ---- BFCL: accuracy vs budget ---------------------------------------------------------------------------------------


def _best_baseline(result: dict, budget: float) -> tuple[str, float]:
    scores = {m: overall(result, m, b) for m, b in _keys(result) if m in BASELINES and math.isclose(b, budget)}
    best = max(scores, key=scores.get)
    return best, scores[best]


def accuracy_table(result: dict) -> str:
    """Accuracy (%) per category (items in the header) with BFCL's three means and the largest kept/full KV."""
    present = {r["category"] for r in result["runs"]}
    categories = [c for c in bfcl.CATEGORIES if c in present]
    sizes = {c: max(len(r["items"]) for r in result["runs"] if r["category"] == c) for c in categories}
    head = ["method", "b", *(f"{c} ({sizes[c]})" for c in categories), "non-live", "live", "overall", "kept/full max"]
    rows = []
    for method, budget in _keys(result):
        scores = category_scores(result, method, budget)
        means = bfcl.summarize(scores)
        cells = [f"{100 * scores[c][0] / scores[c][1]:.0f}" if c in scores else "-" for c in categories]
        kept = max(i["kept_ratio_max"] for i in items_of(result, method, budget))
        rows.append(
            [method, f"{budget:g}", *cells, *(_pct(means[k]) for k in ("non_live", "live", "overall")), f"{kept:.3f}"]
        )
    return _table(head, rows)


def bfcl_sweep_25(root: Path) -> str:
    result = load_json(root, SWEEP)
    for budget in BUDGETS:
        merged = {i: o for f in SWEEP_PASK for i, o in outcomes(load_json(root, f), "pask", budget).items()}
        if merged != outcomes(result, "pask", budget):
            raise ReportError(f"{SWEEP}: PASK at b = {budget:g} differs from its runs in {', '.join(SWEEP_PASK)}")
    parallel = [c for c in bfcl.CATEGORIES if "parallel" in c]
    scoring = sorted(
        {m for m, b in _keys(result) for c, (k, _) in category_scores(result, m, b).items() if c in parallel and k}
    )
    full = overall(result, "full", 1.0)
    parts = []
    for budget in BUDGETS:
        pask = overall(result, "pask", budget)
        best, best_score = _best_baseline(result, budget)
        parts.append(
            f"at b = {budget:g} PASK {_pct(pask)} ({100 * pask / full:.1f}% of full KV's {_pct(full)}), best "
            f"baseline {best} {_pct(best_score)} (PASK {_points(pask - best_score)} points)"
        )
    kept = [
        max(i["kept_ratio_max"] for m, b in _keys(result) if math.isclose(b, x) for i in items_of(result, m, b))
        for x in BUDGETS
    ]
    claim = (
        f"Overall BFCL accuracy on the default evaluation sample ({len(outcomes(result, 'full', 1.0))} items): "
        + "; ".join(parts)
        + ". Largest kept/full KV at any step of any method: "
        + " / ".join(f"{k:.3f}" for k in kept)
        + " at b = "
        + " / ".join(f"{b:g}" for b in BUDGETS)
        + ". Methods with a correct item in a parallel category: "
        + (", ".join(scoring) or "none")
        + "."
    )
    return _block(claim, accuracy_table(result))


# ---- BFCL: the item-hash split's overlap, and paired comparisons ----------------------------------------------------


@functools.cache
def _tool_sets() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Per BFCL item of the eight categories: the fingerprint of its function dicts, and its sorted function names."""
    exact, names = {}, {}
    for category in bfcl.CATEGORIES:
        for item in bfcl.load_category(category):
            exact[item["id"]] = bfcl.tool_set_key(item["function"])
            names[item["id"]] = tuple(sorted(f["name"] for f in item["function"]))
    return exact, names


def _calibration_items(root: Path) -> list[str]:
    """The calibration items of the policy the item-hash sections' PASK results were scored with (the statistics it
    was compiled from), checked to lie in the item-hash calibration part."""
    items = load_json(root, OWN16_STATS)["item_ids"]
    if outside := [i for i in items if bfcl.part_of(i, "item-hash") != "calibration"]:
        raise ReportError(f"{OWN16_STATS}: items {outside[:3]} are not item-hash calibration items")
    return items


def split_overlap(root: Path) -> str:
    result = load_json(root, SWEEP)
    calibration = _calibration_items(root)
    exact, names = _tool_sets()
    calibration_names = {names[i] for i in calibration}
    calibration_exact = {exact[i] for i in calibration}
    rows, totals = [], [0, 0, 0]
    for category in bfcl.CATEGORIES:
        ids = [i["id"] for i in items_of(result, "full", 1.0, [category])]
        if scored := [i for i in ids if bfcl.part_of(i, "item-hash") != "evaluation"]:
            raise ReportError(f"{SWEEP} scores items outside the item-hash evaluation part: {scored[:3]}")
        counts = [
            len(ids),
            sum(names[i] in calibration_names for i in ids),
            sum(exact[i] in calibration_exact for i in ids),
        ]
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
        rows.append([category, *counts])
    rows.append(["**all**", *totals])
    sample = outcomes(result, "full", 1.0)
    schema_parts = Counter(bfcl.part_of(i, "schema") for i in calibration)
    claim = (
        f"Under the item-hash split, {totals[1]} of the {totals[0]} evaluation items of the default sample call the "
        f"same set of functions (by name) as one of the own16 policy's {len(calibration)} calibration items; "
        f"{totals[2]} of them have identical function definitions (names, parameters, descriptions). Under the "
        f"schema rule {schema_parts['evaluation']} of those calibration items are evaluation items and "
        f"{sum(bfcl.part_of(i, 'schema') == 'dev' for i in sample)} of the sample's items are dev items."
    )
    head = ["category", "evaluation items", "same function names as a calibration item", "identical function dicts"]
    return _block(claim, _table(head, rows))


def overlap_pask_dapq(root: Path) -> str:
    """PASK vs DapQ at b = 0.33 on the non-parallel items, split by whether an item shares a calibration tool set."""
    result = load_json(root, SWEEP)
    pask = outcomes(result, "pask", 0.33, NON_PARALLEL)
    dapq = outcomes(result, "dapq", 0.33, NON_PARALLEL)
    _, names = _tool_sets()
    calibration_names = {names[i] for i in _calibration_items(root)}
    shared = {i for i in pask if names[i] in calibration_names}
    subsets = {
        "non-parallel items": set(pask),
        "sharing a calibration item's function names": shared,
        "the others": set(pask) - shared,
    }
    rows = [
        _paired_row(label, {i: pask[i] for i in pask if i in ids}, {i: dapq[i] for i in dapq if i in ids})
        for label, ids in subsets.items()
    ]
    (_, n_all, a_all, b_all, *_), (_, n_shared, a_shared, b_shared, *_), others = rows
    claim = (
        f"At b = 0.33 on the {n_all} non-parallel items PASK (A) leads DapQ (B) {a_all} to {b_all}; on the "
        f"{n_shared} that share a calibration item's functions it is {a_shared} to {b_shared}, on the other "
        f"{others[1]} {others[2]} to {others[3]} (McNemar p = {others[7]})."
    )
    return _block(claim, _table(["subset", *PAIRED_HEAD], rows))


def paired_b033(root: Path) -> str:
    """PASK against DapQ and against full KV, item by item, on the whole default sample."""
    result = load_json(root, SWEEP)
    full = outcomes(result, "full", 1.0)
    rows = []
    for budget in BUDGETS:
        pask = outcomes(result, "pask", budget)
        rows.append(_paired_row(f"PASK vs DapQ, b = {budget:g}", pask, outcomes(result, "dapq", budget)))
        rows.append(_paired_row(f"PASK vs full KV, b = {budget:g}", pask, full))
    dapq, versus_full = rows[2], rows[3]
    claim = (
        f"Item by item over the {dapq[1]} items at b = 0.33, PASK's accuracy minus DapQ's is {dapq[6]} points "
        f"(McNemar p = {dapq[7]}), minus full KV's {versus_full[6]} (p = {versus_full[7]})."
    )
    return _block(claim, _table(["A vs B", *PAIRED_HEAD], rows))


def versus_full(root: Path) -> str:
    """Full KV's correct calls each run loses (by error type) and full KV's errors it gets right."""
    result = load_json(root, SWEEP)
    full = outcomes(result, "full", 1.0)
    rows = {}
    for method, budget in _keys(result):
        items = items_of(result, method, budget)
        lost = [i for i in items if full[i["id"]] and not i["valid"]]
        gained = sum(bool(i["valid"]) and not full[i["id"]] for i in items)
        kinds = Counter(i["error_type"] or "none" for i in lost).most_common()
        rows[method, budget] = [
            method,
            f"{budget:g}",
            "-" if method == "full" else len(lost),
            "-" if method == "full" else gained,
            ", ".join(f"{k} {n}" for k, n in kinds) or "-",
            f"{sum(bool(i['parsed']) for i in items)}/{len(items)}",
            sum(i.get("finish_reason") == "length" for i in items),
        ]
    at_033 = ", ".join(f"{m} {rows[m, 0.33][2]} / {rows[m, 0.33][3]}" for m in ("pask", "dapq", "snapkv"))
    unexplained = sum(
        not i["parsed"] and i.get("finish_reason") != "length" for m, b in _keys(result) for i in items_of(result, m, b)
    )
    claim = (
        f"Of full KV's {sum(full.values())} correct calls, the runs at b = 0.33 lose / gain (full KV's errors they "
        f"get right): {at_033}. Full KV parses {rows['full', 1.0][5]} outputs; {rows['full', 1.0][6]} of them hit "
        f"the {result['config']['max_new_tokens']}-token limit. Outputs of any run that do not parse without having "
        f"hit the limit: {unexplained}."
    )
    head = ["method", "b", "lost", "gained", "lost, by bfcl-eval error type", "parsed", "hit the token limit"]
    return _block(claim, _table(head, list(rows.values())))


# ---- BFCL: ablations and compiler options ---------------------------------------------------------------------------

ABLATIONS_ENTRY_ORDER = "results/bfcl_ablations_entry_order_b033_limit8.json"
ABLATION_REFERENCE = "pask (own16 policy)"  # the row the paired column compares with
ABLATION_ROWS = (  # (label, file, method, budget)
    ("full KV", SWEEP, "full", 1.0),
    ("streamingllm", SWEEP, "streamingllm", 0.33),
    ("dapq", SWEEP, "dapq", 0.33),
    ("snapkv", SWEEP, "snapkv", 0.33),
    (ABLATION_REFERENCE, "results/bfcl_pask_entry_order_b033_limit8.json", "pask", 0.33),
    ("pask:no_floors", "results/bfcl_ablations_own16_tiers_b033_limit8.json", "pask:no_floors", 0.33),
    ("pask:no_distortion", ABLATIONS_ENTRY_ORDER, "pask:no_distortion", 0.33),
    ("pask:one_role", ABLATIONS_ENTRY_ORDER, "pask:one_role", 0.33),
    ("pask:one_group", ABLATIONS_ENTRY_ORDER, "pask:one_group", 0.33),
)


def _ablation_rows(root: Path) -> tuple[list[list], dict[str, int]]:
    """Per ABLATION_ROWS entry, on the reference row's items: correct-% per NON_PARALLEL category, their mean,
    correct / n and the paired counts against the reference; and the correct counts by label."""
    reference = ABLATION_REFERENCE
    files = {f: load_json(root, f) for f in dict.fromkeys(spec[1] for spec in ABLATION_ROWS)}
    got = {label: (files[f], outcomes(files[f], m, b, NON_PARALLEL)) for label, f, m, b in ABLATION_ROWS}
    ref_result, ref = got[reference]
    category = {i["id"]: r["category"] for r in ref_result["runs"] for i in r["items"]}
    rows, correct = [], {}
    for label, (_, outcome) in got.items():
        if missing := [i for i in ref if i not in outcome]:
            raise ReportError(f"{label} lacks the items {missing[:3]}")
        outcome = {i: outcome[i] for i in ref}
        accs = [
            sum(outcome[i] for i in ref if category[i] == c) / sum(category[i] == c for i in ref) for c in NON_PARALLEL
        ]
        _, only_ref, only_this = paired_counts(ref, outcome)
        versus = (
            "-" if label == reference else f"{only_ref} / {only_this}, p = {mcnemar_exact_p(only_ref, only_this):.2f}"
        )
        correct[label] = sum(outcome.values())
        rows.append(
            [
                label,
                *(f"{100 * a:.0f}" for a in accs),
                _pct(sum(accs) / len(accs)),
                f"{correct[label]}/{len(ref)}",
                versus,
            ]
        )
    return rows, correct


def ablations_b033(root: Path) -> str:
    _, file, method, budget = next(row for row in ABLATION_ROWS if row[0] == ABLATION_REFERENCE)
    rows, correct = _ablation_rows(root)
    texts = {i["id"]: i["text"] for i in items_of(load_json(root, SWEEP), method, budget)}
    here = items_of(load_json(root, file), method, budget)
    same = sum(i["text"] == texts.get(i["id"]) for i in here)
    claim = (
        f"On these {len(here)} items at b = 0.33 the own16 policy gets {correct[ABLATION_REFERENCE]} right; its "
        "ablations "
        + ", ".join(f"{label.removeprefix('pask:')} {n}" for label, n in correct.items() if label.startswith("pask:"))
        + f"; full KV {correct['full KV']}, DapQ {correct['dapq']}. The own16 policy's outputs here equal its "
        f"default-sample run's on {same} of the {len(here)} items, text for text."
    )
    head = ["variant", *NON_PARALLEL, "mean", "correct", "only own16 / only variant"]
    return _block(claim, _table(head, rows))


DEV_FILES = {0.33: "results/dev_compiler_b033.json", 0.2: "results/dev_compiler_b02.json"}
DEV_POLICIES = {  # label in the files -> what the policy is (all compiled from the own16 statistics)
    "full": "full KV (b = 1)",
    "pask:shipped": "removal order (results/policies/qwen2.5-coder-0.5b-removal-order)",
    "pask:order": "per-entry order (the own16 policy)",
    "pask:fs05": "per-entry order, `--floor-share 0.5`",
    "pask:tol1": "per-entry order, `--tolerance 0.07`",
    "pask:tol1_fs05": "per-entry order, `--tolerance 0.07 --floor-share 0.5`",
}


def dev_compiler(root: Path) -> str:
    calibrated = {i for f in ITEM_HASH_CALIBRATIONS for i in load_json(root, f)["item_ids"]}
    rows, totals, sizes = [], {}, set()
    for budget, file in DEV_FILES.items():
        result = load_json(root, file)
        for method, b in _keys(result):
            if method not in DEV_POLICIES:
                raise ReportError(f"{file}: method {method} has no description in DEV_POLICIES")
            items = items_of(result, method, b)
            if any(bfcl.part_of(i["id"], "item-hash") != "calibration" for i in items):
                raise ReportError(f"{file}: {method} scores items outside the item-hash dev part")
            if fitted := {i["id"] for i in items} & calibrated:
                raise ReportError(f"{file}: {method} scores calibration items {sorted(fitted)[:3]}")
            scores = category_scores(result, method, b)
            totals[method, budget] = sum(k for k, _ in scores.values())
            sizes.add(len(items))
            cells = [f"{scores[c][0]}/{scores[c][1]}" for c in NON_PARALLEL]
            rows.append([method, DEV_POLICIES[method], f"{b:g}", *cells, f"{totals[method, budget]}/{len(items)}"])
    claim = (
        f"Correct dev items (of {'/'.join(map(str, sorted(sizes)))}) at b = 0.33: "
        + ", ".join(f"{m} {v}" for (m, b), v in totals.items() if b == 0.33)
        + "; at b = 0.2: "
        + ", ".join(f"{m} {v}" for (m, b), v in totals.items() if b == 0.2)
        + "."
    )
    head = ["label", "policy", "b", *NON_PARALLEL, "correct"]
    return _block(claim, _table(head, rows))


TABLES: dict[str, Callable[[Path], str]] = {
    "bfcl_sweep_25": bfcl_sweep_25,
    "split_overlap": split_overlap,
    "overlap_pask_dapq": overlap_pask_dapq,
    "paired_b033": paired_b033,
    "versus_full": versus_full,
    "ablations_b033": ablations_b033,
    "dev_compiler": dev_compiler,
}

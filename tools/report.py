"""The tables of the results documents (docs/results/*.md), computed from the committed results files, and paired
statistics for two methods scored on the same items.

A table sits in the document between ``<!-- table:NAME -->`` and ``<!-- /table -->``; ``TABLES`` maps every NAME
to the function that renders it (a claim sentence with its numbers, then a Markdown table) from the files under the
repository root. ``render_tables`` rewrites every block from its files and leaves the text around the blocks as it
is; ``stale_tables`` names the blocks whose text differs from what their files give (what
``python -m tools.results_tables --check`` reports).

Paired statistics over items: ``paired_bootstrap_ci`` (percentile interval of an accuracy difference, items
resampled with replacement, fixed seed) and ``mcnemar_exact_p`` (two-sided exact binomial test on the discordant
items). Standard library only, plus ``experiments.bfcl`` (the split rule, BFCL's means, the items' tool sets; it loads
no JAX), for one table the role names of ``pask_jax.structure.roles`` and for another ``jsonschema``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import jsonschema

from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.long_context import LAYOUTS
from pask_jax.experiments.bfcl.protocol import choose_variants, dev_totals, method_of

RESAMPLES = 10_000
SEED = 0
BUDGETS = (0.2, 0.33, 0.5)
BASELINES = ("random", "streamingllm", "h2o", "snapkv", "pyramidkv", "dapq")
NON_PARALLEL = ("simple_python", "multiple", "live_simple", "live_multiple")
SHIPPED_POLICY = "pask_jax/policies/qwen2.5-coder-0.5b"
OWN16_STATS = "results/calibration_qwen2.5-coder-0.5b_own16.json"  # the item-hash policy sections 2-5 scored
SWEEP = "results/bfcl_sweep_25.json"
SWEEP_PASK = ("results/bfcl_pask_entry_order.json", "results/bfcl_pask_entry_order_parallel.json")
CLOSING = "<!-- /table -->"
# Markers are whole lines, so a document may quote them inline.
BLOCK = re.compile(r"^<!-- table:([a-z0-9_]+) -->\n(.*?)^<!-- /table -->$", re.DOTALL | re.MULTILINE)
MARKER_LINE = re.compile(r"^<!-- /?table.*$", re.MULTILINE)


class ReportError(ValueError):
    """A results document or results file that the tables cannot be rendered from."""


# ---- paired statistics ----------------------------------------------------------------------------------------------


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p from the discordant counts (items only A gets right, items only B gets right):
    2 P(X <= min(only_a, only_b)) for X ~ Binomial(only_a + only_b, 1/2), at most 1 (1 when none is discordant)."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_a} and {only_b}")
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_bootstrap_ci(
    a: Sequence[bool], b: Sequence[bool], *, resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95
) -> tuple[float, float]:
    """Percentile interval of mean(a) - mean(b) (accuracies as fractions): the items are resampled with replacement
    `resamples` times, item i bringing a[i] and b[i] together (the pairing is kept). Deterministic for a seed."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty outcome lists, got {len(a)} and {len(b)} items")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need resamples >= 1 and level in (0, 1), got {resamples} and {level}")
    diffs = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return means[math.floor(tail * (resamples - 1))], means[math.ceil((1.0 - tail) * (resamples - 1))]


def paired_counts(a: dict[str, bool], b: dict[str, bool]) -> tuple[list[str], int, int]:
    """The items both cover (in a's order), how many only a gets right, and how many only b."""
    items = [i for i in a if i in b]
    return items, sum(a[i] and not b[i] for i in items), sum(b[i] and not a[i] for i in items)


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


def _best_baseline(result: dict, budget: float) -> tuple[str, float]:
    scores = {m: overall(result, m, b) for m, b in _keys(result) if m in BASELINES and math.isclose(b, budget)}
    best = max(scores, key=scores.get)
    return best, scores[best]


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


# ---- BFCL: accuracy vs budget ---------------------------------------------------------------------------------------


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


PAIRED_HEAD = ("items", "A right", "B right", "only A", "only B", "A - B, points [95% CI]", "McNemar p")


@dataclasses.dataclass(frozen=True)
class Paired:
    """A against B item by item over the items both scored: counts and the 95% paired bootstrap interval of the
    accuracy difference."""

    items: int
    right_a: int
    right_b: int
    only_a: int
    only_b: int
    low: float
    high: float

    @property
    def difference(self) -> str:  # points, with the interval
        return f"{_points((self.right_a - self.right_b) / self.items)} [{_points(self.low)}, {_points(self.high)}]"

    @property
    def p(self) -> str:  # McNemar's exact p
        return f"{mcnemar_exact_p(self.only_a, self.only_b):.3f}"

    def row(self, label: str) -> list[object]:  # a row of PAIRED_HEAD
        return [label, self.items, self.right_a, self.right_b, self.only_a, self.only_b, self.difference, self.p]


def paired(a: dict[str, bool], b: dict[str, bool]) -> Paired:
    items, only_a, only_b = paired_counts(a, b)
    low, high = paired_bootstrap_ci([a[i] for i in items], [b[i] for i in items])
    right_a, right_b = sum(a[i] for i in items), sum(b[i] for i in items)
    return Paired(len(items), right_a, right_b, only_a, only_b, low, high)


def _paired_row(label: str, a: dict[str, bool], b: dict[str, bool]) -> list[object]:
    """A row of PAIRED_HEAD: counts, the item-weighted accuracy difference with its bootstrap interval, McNemar p."""
    return paired(a, b).row(label)


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


# ---- BFCL: the schema split, every method tuned on dev by one rule, frozen, then scored ---------------------------

DEV_TUNING = "results/dev_tuning/dev_b033.json"
SCHEMA_EVAL = "results/bfcl_schema_eval.json"
SCHEMA_EVAL_1_5B = "results/bfcl_schema_eval_qwen2.5-coder-1.5b.json"  # section 1's frozen methods, 1.5B
SCHEMA_EVAL_BUDGETS = "results/bfcl_schema_eval_budgets.json"  # the same, b = 0.2 / 0.33 / 0.5
SCHEMA_EVAL_B02 = "results/bfcl_schema_eval_b02_b033.json"  # the same, b = 0.2 and 0.33, four categories
TUNING_BUDGET = 0.33


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Where a frozen table's variants were chosen: dev results (read as one) and the budget the rule compared at."""

    files: tuple[str, ...]
    budget: float
    pask_from: Tuning | None = None  # PASK's variant chosen by another tuning (PASK v2's, on long dev prompts)

    def choices(self, root: Path, dev: dict | None = None) -> dict[str, str]:
        """method -> the variant the dev rule chose (PASK's from `pask_from` where given); `dev`: this tuning's dev
        result when the caller has read it already."""
        chosen = choose_variants(self.dev_result(root) if dev is None else dev, self.budget)
        if self.pask_from is not None:
            chosen["pask"] = self.pask_from.choices(root)["pask"]
        return chosen

    def dev_parts(self, root: Path) -> list[dict]:
        """Each dev file's result, refused if it scores any item outside the dev part."""
        results = [load_json(root, f) for f in self.files]
        for file, result in zip(self.files, results, strict=True):
            for spec, b in _keys(result):
                if any(bfcl.part_of(i["id"]) != "dev" for i in items_of(result, spec, b)):
                    raise ReportError(f"{file}: {spec} scores items outside the schema split's dev part")
        return results

    def dev_result(self, root: Path, parts: list[dict] | None = None) -> dict:
        """The dev files read as one result: their runs in order, the first file's config with every file's method
        sections and policies (a variant run in a later file keeps its own settings)."""
        parts = self.dev_parts(root) if parts is None else parts
        config = dict(parts[0]["config"])
        for key in ("method_config", "policies"):
            config[key] = {k: v for part in reversed(parts) for k, v in part["config"].get(key, {}).items()}
        return {"config": config, "runs": [run for r in parts for run in r["runs"]]}


SHORT_TUNING = Tuning((DEV_TUNING,), TUNING_BUDGET)  # the frozen methods of section 1
V2_TUNING = Tuning(  # PASK v2 on long prompts: the long-prompt baselines' dev runs with PASK v2's candidates
    ("results/dev_v2/bfcl_dev_long2k_v2_question_last.json", "results/dev_v2/bfcl_dev_long2k_v2_question_first.json"),
    0.2,
)
SHORT_V2_TUNING = Tuning((DEV_TUNING,), TUNING_BUDGET, pask_from=V2_TUNING)  # short prompts under PASK v2
QUERY_FLOORS_LONG = Tuning(  # PASK's default against query-ranked floors on the long dev prompts (main's code)
    (
        "results/dev_v2/bfcl_dev_long2k_query_floors_question_last.json",
        "results/dev_v2/bfcl_dev_long2k_query_floors_question_first.json",
    ),
    0.2,
)
REGIMES_LONG = Tuning(  # the policies calibrated in several regimes (21 and 45 prompts) against the shipped one
    tuple(
        f"results/dev_v3/bfcl_dev_long2k_{policies}_{layout}.json"
        for policies in ("regimes", "regimes48")
        for layout in LAYOUTS
    ),
    0.2,
)
REGIMES_SHORT = tuple(  # the same policies on BFCL's own dev prompts
    f"results/dev_v3/bfcl_dev_short_{policies}.json" for policies in ("regimes", "regimes48")
)
QUERIES_LONG = Tuning(  # PASK's query-aware order reading the pseudo queries, the observation window or both
    tuple(f"results/dev_v4/bfcl_dev_long2k_queries_{layout}.json" for layout in LAYOUTS),
    0.2,
)
WINDOW_TUNING = Tuning(V2_TUNING.files, 0.2, pask_from=QUERIES_LONG)  # the baselines of PASK v2's long sample
LONG_V3 = {  # the fresh sample of pask:window (items 110-119): layout -> results file
    layout: f"results/long_v3/bfcl_long2k_v3_{layout}.json" for layout in LAYOUTS
}
QUERIES_SHORT = ("results/dev_v4/bfcl_dev_short_queries.json",)  # the same variants on BFCL's own dev prompts
WHOLE_TOOLS_LONG = Tuning(  # PASK's default against its whole-tool order on the long dev prompts
    tuple(f"results/dev_v5/bfcl_dev_long2k_whole_tools_{layout}.json" for layout in LAYOUTS),
    0.2,
)
WHOLE_TOOLS_SHORT = ("results/dev_v5/bfcl_dev_short_whole_tools.json",)  # and on BFCL's own dev prompts
HELD_OUT_DEV = {  # dev items 8-19 of each category, read by no choice: layout -> results file (b = 0.2)
    layout: f"results/dev_v6/bfcl_dev2_long2k_{layout}.json" for layout in LAYOUTS
}
FIRST_DEV = {  # where the same methods ran on dev items 0-7 (the items the long-prompt choices read)
    "full": V2_TUNING,
    "snapkv": V2_TUNING,
    "dapq": V2_TUNING,
    "pask": WHOLE_TOOLS_LONG,  # the default order, beside the whole-tool order, from main's code
    "pask:window": QUERIES_LONG,
}
DEV_1_5B = Tuning(("results/dev_1_5b/dev_b033.json",), TUNING_BUDGET)  # the 1.5B model's own dev grid
SHORT_1_5B = "results/bfcl_1_5b_v2/bfcl_1_5b_v2.json"  # its frozen sample, every baseline at its dev choice
LONG_TUNING = Tuning(  # long prompts: every method's variant chosen on long dev prompts, both layouts
    ("results/dev_long/bfcl_dev_long2k_question_last.json", "results/dev_long/bfcl_dev_long2k_question_first.json"),
    0.2,
)
METHOD_NAMES = {"streamingllm": "StreamingLLM", "h2o": "H2O", "snapkv": "SnapKV", "pyramidkv": "PyramidKV"}
METHOD_NAMES |= {"dapq": "DapQ", "pask": "PASK", "full": "full KV"}


def _settings(result: dict, spec: str) -> str:
    """A spec's hyper-parameters as the run used them: its section over its method's (PASK: plus its policy)."""
    method, _, label = spec.partition(":")
    config = result["config"]["method_config"]
    values = config.get(method, {}) | config.get(spec, {})
    text = ", ".join(f"{k}={v}" for k, v in values.items()) or "-"
    if method == "pask":
        policies = result["config"]["policies"]
        policy = policies.get(label, policies.get("pask"))
        option = re.findall(r"--(tolerance|floor-share) ([0-9.]+)", policy["notes"]) if policy else []
        text += "; policy " + (", ".join(f"{k} {v}" for k, v in option) or "default compile")
    return text


def dev_tuning(root: Path, tuning: Tuning = SHORT_TUNING) -> str:
    """Every method's variants on the dev items at the tuning budget, the rule's choice marked (per prompt layout too,
    when the dev files have several)."""
    parts = tuning.dev_parts(root)
    result = tuning.dev_result(root, parts)
    layout_of = [part["config"].get("layout", "question_last") for part in parts]  # older files: BFCL's own layout
    layouts = list(dict.fromkeys(layout_of))
    by_layout = {  # a column per layout only when there are several
        layout: tuning.dev_result(root, [part for part, of in zip(parts, layout_of, strict=True) if of == layout])
        for layout in (layouts if len(layouts) > 1 else [])
    }
    chosen = tuning.choices(root, result)  # PASK's mark follows `pask_from` where the tuning takes it elsewhere
    totals = dev_totals(result, tuning.budget)
    present = [c for c in bfcl.CATEGORIES if any(r["category"] == c for r in result["runs"])]
    rows = []
    for spec, (correct, n) in totals.items():
        scores = category_scores(result, spec, 1.0 if spec == "full" else tuning.budget)
        cells = [f"{scores[c][0]}/{scores[c][1]}" for c in present]
        per_layout = ["{}/{}".format(*dev_totals(layout, tuning.budget)[spec]) for layout in by_layout.values()]
        mark = "**chosen**" if chosen.get(method_of(spec)) == spec else ""
        rows.append([spec, _settings(result, spec), *cells, *per_layout, f"{correct}/{n}", mark])
    (n,) = {n for _, n in totals.values()}
    claim = (
        f"On {n} dev items at b = {tuning.budget:g}"
        + (f" (full KV {totals['full'][0]})" if "full" in totals else "")
        + ", the rule chose "
        + ", ".join(f"{spec} ({totals[spec][0]})" for spec in chosen.values() if spec in totals)
        + "."
    )
    head = ["variant", "settings", *present, *(layout.replace("_", " ") for layout in by_layout), "correct", ""]
    return _block(claim, _table(head, rows))


def dev_held_out(
    root: Path, held_out_files: Sequence[str] = tuple(HELD_OUT_DEV.values()), first_dev: dict[str, Tuning] = FIRST_DEV
) -> str:
    """The long-prompt methods on held-out dev items (8-19 of each category, read by no choice) beside dev items 0-7
    (what the choices read, `first_dev`: method -> its dev files), per layout; then PASK paired against each other
    row on the held-out items and on all."""
    budget = 0.2
    held_out = [load_json(root, file) for file in held_out_files]
    first = {tuning: tuning.dev_parts(root) for tuning in dict.fromkeys(first_dev.values())}  # a file per layout

    def scored(results: list[dict], spec: str) -> dict[tuple[str, str], bool]:  # (item id, layout) -> correct
        b = 1.0 if spec == "full" else budget
        return {(i, r["config"]["layout"]): ok for r in results for i, ok in outcomes(r, spec, b).items()}

    by_spec = {spec: (scored(first[tuning], spec), scored(held_out, spec)) for spec, tuning in first_dev.items()}
    for spec, (seen, new) in by_spec.items():
        if any(bfcl.part_of(item) != "dev" for item, _ in new) or set(seen) & set(new):
            raise ReportError(f"{spec}: the held-out items must be dev items the first dev files did not score")
    rows = []
    for spec, (seen, new) in by_spec.items():
        cells = [
            f"{sum(ok for (_, of), ok in part.items() if of == layout)}/{sum(of == layout for _, of in part)}"
            for layout in LAYOUTS
            for part in (seen, new)
        ]
        every = sum(seen.values()) + sum(new.values())
        rows.append([spec, *cells, f"{sum(new.values())}/{len(new)}", f"{every}/{len(seen) + len(new)}"])
    pask_seen, pask_new = by_spec["pask"]
    comparisons = []
    for other, (seen, new) in by_spec.items():
        if other != "pask":
            comparisons.append(_paired_row(f"PASK vs {other}, items 8-19", pask_new, new))
            comparisons.append(_paired_row(f"PASK vs {other}, items 0-19", pask_seen | pask_new, seen | new))
    claim = (
        f"On {len(pask_new)} held-out long dev prompts (dev items 8-19 of each category, both layouts, b = {budget:g}, "
        "full KV unbudgeted): " + ", ".join(f"{spec} {sum(new.values())}" for spec, (_, new) in by_spec.items()) + "."
    )
    columns = [f"{layout.replace('_', ' ')}, items {items}" for layout in LAYOUTS for items in ("0-7", "8-19")]
    head = ["method", *columns, "items 8-19", "items 0-19"]
    return _block(claim, _table(head, rows), _table(["A vs B", *PAIRED_HEAD], comparisons))


def _frozen_eval(
    root: Path, file: str = SCHEMA_EVAL, tuning: Tuning = SHORT_TUNING
) -> tuple[dict, dict[str, str], list[str]]:
    """The evaluation result, the dev rule's choice per method, and the categories where full KV scores above 0 and
    every scored method ran at every budget it scored.

    Refuses a result that scored any variant other than the rule's choice and the method's default (reported beside
    it), or any item outside the evaluation part."""
    result = load_json(root, file)
    chosen = tuning.choices(root)
    scored = {spec for spec, _ in _keys(result)} - {"full"}
    if stray := sorted(scored - set(chosen.values()) - set(chosen)):
        raise ReportError(f"{file} scores {stray}, neither the dev rule's choice ({chosen}) nor a default")
    for spec, b in _keys(result):
        if any(bfcl.part_of(i["id"]) != "evaluation" for i in items_of(result, spec, b)):
            raise ReportError(f"{file}: {spec} scores items outside the schema split's evaluation part")
    full = category_scores(result, "full", 1.0)
    ran = [set(category_scores(result, spec, b)) for spec, b in _keys(result) if spec != "full"]  # at every budget
    positive = [c for c in bfcl.CATEGORIES if c in full and full[c][0] > 0 and all(c in r for r in ran)]
    return result, {m: spec for m, spec in chosen.items() if spec in scored}, positive


def _scored_budgets(result: dict, spec: str) -> list[float]:
    return sorted({b for s, b in _keys(result) if s == spec})


def _eval_row(result: dict, spec: str, budget: float, positive: list[str], columns: list[str]) -> list[str]:
    scores = category_scores(result, spec, budget)
    cells = [f"{100 * scores[c][0] / scores[c][1]:.0f}" if c in scores else "not run" for c in columns]
    on_positive = sum(scores[c][0] / scores[c][1] for c in positive) / len(positive)
    eight = None  # BFCL's 8-category mean, once a row has every category (one cut for full KV = 0 counts 0)
    if len(scores) == len(bfcl.CATEGORIES) or set(scores) | set(_zero_for_full(result)) >= set(bfcl.CATEGORIES):
        eight = sum(scores[c][0] / scores[c][1] for c in scores) / len(bfcl.CATEGORIES)
    return [spec, f"{budget:g}", *cells, _pct(on_positive), _pct(eight)]


def _zero_for_full(result: dict) -> list[str]:
    return [c for c, (k, _) in category_scores(result, "full", 1.0).items() if k == 0]


def _shown_specs(result: dict, chosen: dict[str, str], budget: float) -> list[str]:
    """The specs a frozen table shows at `budget`: per method its tuned variant, then its default where it differs
    and was run."""
    keys = set(_keys(result))
    return [s for m, spec in chosen.items() for s in dict.fromkeys((spec, m)) if (s, budget) in keys]


def _best_tuned(result: dict, chosen: dict[str, str], budget: float, positive: list[str]) -> str:
    """The tuned baseline with the most correct items over the full-KV-positive categories at `budget`."""
    baselines = [spec for m, spec in chosen.items() if m != "pask" and (spec, budget) in set(_keys(result))]
    return max(baselines, key=lambda spec: sum(outcomes(result, spec, budget, positive).values()))


def schema_eval(root: Path, file: str = SCHEMA_EVAL) -> str:
    """Accuracy per category, the mean over the categories where full KV scores above 0 and the 8-category mean."""
    result, chosen, positive = _frozen_eval(root, file)
    full = category_scores(result, "full", 1.0)
    columns = [c for c in bfcl.CATEGORIES if c in full]
    rows = [_eval_row(result, "full", 1.0, positive, columns)]
    budgets = _scored_budgets(result, chosen["pask"])
    for budget in budgets:
        rows += [_eval_row(result, s, budget, positive, columns) for s in _shown_specs(result, chosen, budget)]
    cut = [c for c in columns if c not in positive]
    items = sum(n for _, n in full.values())
    parts = []
    for budget in budgets:
        best = _best_tuned(result, chosen, budget, positive)
        pask, base = (_eval_row(result, spec, budget, positive, columns) for spec in (chosen["pask"], best))
        parts.append(f"at b = {budget:g} PASK {pask[-2]}, best tuned baseline {best} {base[-2]}")
    claim = (
        f"{result['model']}, on the frozen evaluation sample as scored so far ({items} items of the schema split's "
        "evaluation part): full KV scores "
        f"{rows[0][-2]} on the {len(positive)} categories where it scores above 0 and every method ran "
        f"({', '.join(positive)}); "
        + "; ".join(parts)
        + f". Not in that mean: {', '.join(cut) or 'none'} (categories not yet run for every method)."
    )
    head = ["method", "b", *columns, "mean where full KV > 0 and all ran", "8-category mean"]
    return _block(claim, _table(head, rows))


def schema_paired(root: Path, file: str = SCHEMA_EVAL) -> str:
    """PASK against the best tuned baseline and against full KV, item by item, on the full-KV-positive categories."""
    result, chosen, positive = _frozen_eval(root, file)
    full = outcomes(result, "full", 1.0, positive)
    pask_spec = chosen["pask"]
    rows = []
    for budget in _scored_budgets(result, pask_spec):
        pask = outcomes(result, pask_spec, budget, positive)
        best = _best_tuned(result, chosen, budget, positive)
        rows.append(_paired_row(f"PASK vs {best}, b = {budget:g}", pask, outcomes(result, best, budget, positive)))
        rows.append(_paired_row(f"PASK vs full KV, b = {budget:g}", pask, full))
    parts = [f"{row[0].replace('PASK vs ', 'minus ')}: {row[6]} (p = {row[7]})" for row in rows]
    claim = f"Item by item over the {rows[0][1]} items of {', '.join(positive)}, PASK's accuracy " + "; ".join(parts)
    return _block(claim + ".", _table(["A vs B", *PAIRED_HEAD], rows))


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


WRONG_FUNCTION = "simple_function_checker:wrong_func_name"  # BFCL's error type for a call to another function


def _strongest_baseline(result: dict, budget: float, positive: list[str]) -> str:
    """The baseline row (tuned or default) with the most correct items at `budget`: the comparison hardest for PASK
    (reported, never used to choose anything)."""
    baselines = [s for s, b in _keys(result) if math.isclose(b, budget) and method_of(s) not in ("full", "pask")]
    return max(baselines, key=lambda s: sum(outcomes(result, s, budget, positive).values()))


def long_prompts(root: Path, file: str, tuning: Tuning = SHORT_TUNING) -> str:
    """Long prompts under frozen methods (chosen by `tuning`): accuracy per category and over the full-KV-positive
    categories, the prompt lengths and grammar time, then PASK (its chosen variant, and its default where that
    differs) paired against the strongest baseline row (tuned or default) and full KV per budget."""
    result, chosen, positive = _frozen_eval(root, file, tuning)
    cfg = result["config"]
    full = category_scores(result, "full", 1.0)
    columns = [c for c in bfcl.CATEGORIES if c in full]

    def row(spec: str, budget: float) -> list[str]:  # ... and how many items called another function than asked
        wrong = sum(i["error_type"] == WRONG_FUNCTION for i in items_of(result, spec, budget, positive))
        return [*_eval_row(result, spec, budget, positive, columns)[:-1], wrong]

    rows = [row("full", 1.0)]
    paired, parts = [], []
    for budget in _scored_budgets(result, chosen["pask"]):
        rows += [row(s, budget) for s in _shown_specs(result, chosen, budget)]
        best = _strongest_baseline(result, budget, positive)
        named, differences = [], []
        for spec in [s for s in _shown_specs(result, chosen, budget) if method_of(s) == "pask"]:
            name = "PASK" if spec == "pask" else spec
            pask = outcomes(result, spec, budget, positive)
            paired.append(
                _paired_row(f"{name} vs {best}, b = {budget:g}", pask, outcomes(result, best, budget, positive))
            )
            paired.append(
                _paired_row(f"{name} vs full KV, b = {budget:g}", pask, outcomes(result, "full", 1.0, positive))
            )
            named.append(f"{name} {sum(pask.values())}")
            differences.append(f"{name} - {best} {paired[-2][6]}, p = {paired[-2][7]}")
        parts.append(f"b = {budget:g}: {', '.join(named)}, {best} {paired[-2][3]} ({'; '.join(differences)})")
    lengths = [i["prompt_tokens"] for i in items_of(result, "full", 1.0)]
    runs = _runs(result, "full", 1.0)
    prepare = sum(r["prepare_s"] for r in runs) / sum(r["n"] for r in runs)
    shape = f"at most {cfg['context']}, {cfg['layout'].replace('_', ' ')}" if cfg["context"] else "BFCL's own prompts"
    claim = (
        f"{len(pask)} evaluation questions ({', '.join(positive)}) in prompts of {min(lengths)}-{max(lengths)} tokens "
        f"({shape}), every tool of the prompt in the grammar "
        f"({prepare:.1f} s per prompt to build it and compile its grammar): full KV {sum(full[c][0] for c in positive)}"
        f" correct; " + "; ".join(parts) + "."
    )
    head = ["method", "b", *columns, "mean where full KV > 0", "wrong function called"]
    return _block(claim, _table(head, rows), _table(["A vs B", *PAIRED_HEAD], paired))


LONG_V2 = {  # the frozen PASK v2's long-prompt tables: name -> results file (tuned by V2_TUNING)
    "2k_v2_question_last": "results/long_v2/bfcl_long2k_v2_budgets_question_last.json",  # b = 0.2, 0.1 / 0.33 merged in
    "2k_v2_question_first": "results/long_v2/bfcl_long2k_v2_budgets_question_first.json",  # the same, question first
    "2k_v2_1_5b_question_last": "results/long_v2/bfcl_long2k_v2_1_5b_question_last.json",
    "2k_v2_1_5b_question_first": "results/long_v2/bfcl_long2k_v2_1_5b_question_first.json",
    "4k_v2_question_last": "results/long_v2/bfcl_long4k_v2_question_last.json",
    "4k_v2_question_first": "results/long_v2/bfcl_long4k_v2_question_first.json",
}


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    """One frozen evaluation sample of the README's table."""

    model: str
    prompts: str
    file: str
    tuning: Tuning


SHORT_V2_POOLED = "results/short_v2/bfcl_short_v2_pooled.json"  # PASK v2's short-prompt sample, items 0-24 and 60-84
DEFAULT_PASK_SAMPLES = (  # the default PASK's frozen evaluation samples
    FrozenSample("0.5B", "BFCL's own (under 800 tokens)", SHORT_V2_POOLED, SHORT_V2_TUNING),
    FrozenSample("0.5B", "2k tokens, question last", LONG_V2["2k_v2_question_last"], V2_TUNING),
    FrozenSample("0.5B", "2k tokens, question first", LONG_V2["2k_v2_question_first"], V2_TUNING),
    FrozenSample("0.5B", "4k tokens, question last", LONG_V2["4k_v2_question_last"], V2_TUNING),
    FrozenSample("0.5B", "4k tokens, question first", LONG_V2["4k_v2_question_first"], V2_TUNING),
    FrozenSample("1.5B", "BFCL's own (under 3k tokens)", SHORT_1_5B, DEV_1_5B),
    FrozenSample("1.5B", "2k tokens, question last", LONG_V2["2k_v2_1_5b_question_last"], V2_TUNING),
    FrozenSample("1.5B", "2k tokens, question first", LONG_V2["2k_v2_1_5b_question_first"], V2_TUNING),
)


def readme_default(root: Path, samples: Sequence[FrozenSample] = DEFAULT_PASK_SAMPLES) -> str:
    """The README's table of the default PASK: per frozen sample and budget, correct items of full KV, PASK and the
    strongest baseline row, with PASK's paired differences against both."""
    rows, comparisons = [], []  # comparisons: PASK against the strongest baseline, per row
    for sample in samples:
        result, chosen, positive = _frozen_eval(root, sample.file, sample.tuning)
        spec = chosen["pask"]
        full = outcomes(result, "full", 1.0, positive)
        for budget in _scored_budgets(result, spec):
            best = _strongest_baseline(result, budget, positive)
            pask = outcomes(result, spec, budget, positive)
            against_best = paired(pask, outcomes(result, best, budget, positive))
            against_full = paired(pask, full)
            comparisons.append(against_best)
            rows.append(
                [sample.model, sample.prompts, f"{budget:g}", len(pask), sum(full.values()), sum(pask.values()),
                 f"{best} {against_best.right_b}", f"{against_best.difference}, p = {against_best.p}",
                 f"{against_full.difference}, p = {against_full.p}"]
            )  # fmt: skip
    ahead = sum(c.right_a > c.right_b for c in comparisons)
    behind = sum(c.right_a < c.right_b for c in comparisons)
    clear = sum(c.low > 0 or c.high < 0 for c in comparisons)
    claim = (
        f"The default PASK on its frozen evaluation samples (BFCL's non-parallel categories, items no choice looked "
        f"at), against the strongest baseline row: ahead in {ahead} of {len(rows)} sample-budget cells, behind in "
        f"{behind}; the 95% interval excludes 0 in {clear}."
    )
    head = ["model", "prompts", "b", "items", "full KV", "PASK", "strongest baseline", "PASK - strongest",
            "PASK - full KV"]  # fmt: skip
    return _block(claim, _table(head, rows))


# ---- calibration ----------------------------------------------------------------------------------------------------

ITEM_HASH_CALIBRATIONS = (  # calibrated on the item-hash split's calibration part (sections 2-5 use them)
    "results/calibration_qwen2.5-coder-0.5b_8items.json",
    "results/calibration_qwen2.5-coder-0.5b_own16.json",
    "results/calibration_qwen2.5-coder-0.5b_own31.json",
)
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


# ---- serving, decode, kernel, parity, cache bytes -------------------------------------------------------------------


def _serving(root: Path, file: str) -> str:
    result = load_json(root, file)
    runs = result["runs"]
    full = next(r for r in runs if r["method"] == "full")
    rows, gains = [], []  # gains: (method, budget, batch, decode x full, end to end x full) of the compressed runs
    for r in runs:
        ratio = r["ratio_vs_full"]
        decode = r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        if r is not full:
            gains.append((r["method"], r["budget"], r["batch"], decode, ratio["throughput"]))
        rows.append(
            [
                r["method"],
                f"{r['budget']:g}",
                r["batch"],
                f"{r['decode_tokens_per_s']:.1f} ({_ratio(decode)})",
                f"{r['tokens_per_s']:.2f} ({_ratio(ratio['throughput'])})",
                f"{r['tpot_ms']:.0f} ({_ratio(ratio['tpot'])})",
                f"{r['ttft_ms'] / 1000:.1f}",
                f"{r['memory']['cache_bytes'] / 2**20:.1f} ({_ratio(ratio['cache_bytes'])})",
                f"{r['peak_memory_bytes'] / 2**20:.0f} ({_ratio(ratio['peak_memory'])})",
                f"{r['parser_ms_per_step']:.2f}",
                r["recompiles_after_warmup"],
            ]
        )
    workload = next(iter(result["workloads"].values()))
    claim = (
        f"Under full KV's cache at batch {full['batch']} ({workload['memory_limit_bytes'] / 2**20:.1f} MiB; prompts "
        f"of {min(workload['prompt_tokens'])}-{max(workload['prompt_tokens'])} tokens), decode tokens/s against full "
        f"KV's {full['decode_tokens_per_s']:.1f}: "
        + ", ".join(f"{m} b = {b:g} at batch {n} {_ratio(d)}" for m, b, n, d, _ in gains)
        + "; end to end (prefill included) "
        + " / ".join(_ratio(e) for *_, e in gains)
        + "; recompiles after warm-up: "
        + str(sum(r["recompiles_after_warmup"] for r in runs))
        + "."
    )
    head = [
        "method", "b", "batch", "decode tokens/s (x full)", "tokens/s end to end (x full)", "TPOT ms (x full)",
        "TTFT s", "KV cache MiB (x full)", "peak MiB (x full)", "parser ms/step", "recompiles",
    ]  # fmt: skip
    tables = [_table(head, rows)]
    if sweep := result.get("decode_sweep"):
        points = [
            [f"{p['budget']:g}", f"{p['capacity_slots_mean']:.0f}", f"{p['tpot_ms']['median']:.0f}",
             _ratio(p["tpot_ratio_vs_top_budget"]), p["recompiles_after_warmup"]]
            for p in sweep["points"]
        ]  # fmt: skip
        tables.append(
            f"Decode-step sweep ({sweep['method']}, batch {sweep['batch']}, {sweep['workload']} prompts):\n\n"
            + _table(["b", "slots per layer", "TPOT ms", "TPOT x b = 1", "recompiles"], points)
        )
    return _block(claim, *tables)


def _run_label(run: dict) -> str:
    return run["method"] if run["method"] == "full" else f"{run['method']} b = {run['budget']:g}"


def _serving_stream(root: Path, file: str) -> str:
    """A request-stream result (`bench serving --scheduler`): per workload, every (method, budget, scheduler)."""
    result = load_json(root, file)
    blocks = []
    for name, part in result["workloads"].items():
        runs = part["runs"]
        rows = [
            [
                r["method"], f"{r['budget']:g}", r["scheduler"], r["rows"], f"{r['requests_per_s']:.3f}",
                _ratio(r["ratio_vs_full"]["requests_per_s"]),
                "-" if r["requests_per_s_vs_static"] is None else _ratio(r["requests_per_s_vs_static"]),
                f"{r['output_tokens_per_s']:.2f}", f"{r['ttft_p50_ms'] / 1000:.1f} / {r['ttft_p95_ms'] / 1000:.1f}",
                f"{r['latency_p50_ms'] / 1000:.1f} / {r['latency_p95_ms'] / 1000:.1f}", f"{r['tpot_ms']:.0f}",
                f"{r['cache_bytes'] / 2**20:.1f}", r["recompiles_after_warmup"],
            ]
            for r in runs
        ]  # fmt: skip
        tokens, memory_rows = part["prompt_tokens"], result["config"]["memory_batch"]
        continuous = [r for r in runs if r["scheduler"].startswith("continuous") and r["method"] != "full"]
        over_static = [
            f"{_run_label(r)} {_ratio(r['requests_per_s_vs_static'])}"
            for r in runs
            if r["scheduler"].startswith("continuous") and r["requests_per_s_vs_static"] is not None
        ]
        claim = (
            f"{name}: {len(tokens)} requests (prompts of {min(tokens)}-{max(tokens)} tokens, answers to EOS or "
            f"{result['config']['max_new_tokens']} tokens) under full KV's cache at {memory_rows} "
            f"row{'' if memory_rows == 1 else 's'} ({part['memory_limit_bytes'] / 2**20:.1f} MiB). "
            "Continuous batching, requests/s against full KV's: "
            + ", ".join(
                f"{_run_label(r)} ({r['rows']} rows) {_ratio(r['ratio_vs_full']['requests_per_s'])}" for r in continuous
            )
            + ("; against static batching of the same method: " + ", ".join(over_static) if over_static else "")
            + "."
        )
        head = [
            "method", "b", "scheduler", "rows", "requests/s", "x full", "x static", "output tokens/s",
            "TTFT p50 / p95 s", "latency p50 / p95 s", "TPOT ms", "KV MiB", "recompiles",
        ]  # fmt: skip
        blocks.append(_block(claim, _table(head, rows)))
    return "\n\n".join(blocks)


def serving_stream_cpu_bfcl64(root: Path) -> str:
    return _serving_stream(root, "results/serving_stream_cpu_bfcl64.json")


def serving_stream_cpu_2k(root: Path) -> str:
    return _serving_stream(root, "results/serving_stream_cpu_2k.json")


def serving_stream_cpu_bfcl64_b02(root: Path) -> str:
    return _serving_stream(root, "results/serving_stream_cpu_bfcl64_b02.json")


def serving_grammar_overlap(root: Path) -> str:
    """Continuous batching with the next token masks built while the step runs against before it (continuous-sync)."""
    result = load_json(root, "results/serving_stream_grammar_overlap.json")
    ((name, part),) = result["workloads"].items()  # one workload
    runs = {(r["method"], r["budget"], r["scheduler"]): r for r in part["runs"]}
    rows, found = [], []
    for r in (r for r in part["runs"] if r["scheduler"] == "continuous"):
        sync, ratio = runs[r["method"], r["budget"], "continuous-sync"], r["vs_sync"]
        rows.append(
            [
                r["method"], f"{r['budget']:g}", r["rows"],
                f"{r['requests_per_s']:.3f} / {sync['requests_per_s']:.3f}", _ratio(ratio["requests_per_s"]),
                f"{r['tpot_ms']:.0f} / {sync['tpot_ms']:.0f}", _ratio(ratio["tpot_ms"]),
            ]
        )  # fmt: skip
        found.append(
            f"{r['method']} b = {r['budget']:g} requests/s {_ratio(ratio['requests_per_s'])}, "
            f"TPOT {_ratio(ratio['tpot_ms'])}"
        )
    claim = (
        f"{name}: {len(part['prompt_tokens'])} requests, continuous batching with the next token masks built on the "
        "host while the step runs, against built before it (medians of per-repeat ratios): " + ", ".join(found) + "."
    )
    head = ["method", "b", "rows", "requests/s, overlapped / masks first", "x", "TPOT ms, overlapped / first", "x"]
    return _block(claim, _table(head, rows))


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


def serving_cpu_2k(root: Path) -> str:
    return _serving(root, "results/serving_cpu_2k.json")


def serving_cpu_bfcl(root: Path) -> str:
    return _serving(root, "results/serving_cpu_bfcl.json")


def bench_decode(root: Path, file: str = "results/bench_decode.json") -> str:
    """Ours against transformers per batch and torch thread count, with each side's share of the memory roofline."""
    result = load_json(root, file)
    rows, identical_rows, compared_rows = [], 0, 0
    for entry in result["results"]:
        ours, roof = entry["ours"], entry["roofline"]
        for side, ratios in (
            ("transformers", "ours_over_transformers"),
            ("transformers_1_thread", "ours_over_transformers_1_thread"),
        ):
            if side not in entry:
                continue
            theirs, ratio = entry[side], entry[ratios]
            same = entry["same_greedy_tokens"]
            identical = same["rows_identical"] if side == "transformers" else same[f"{side}_rows_identical"]
            threads = 1 if side.endswith("1_thread") else result["machine"]["torch_threads"]
            identical_rows, compared_rows = identical_rows + identical, compared_rows + same["rows"]
            rows.append(
                [
                    entry["batch"],
                    f"{entry['prompt_lengths']['mean']:.0f}",
                    threads,
                    f"{ours['prefill_tok_s']:.1f} / {theirs['prefill_tok_s']:.1f}",
                    _ratio(ratio["prefill_speedup"]),
                    f"{ours['decode_tok_s']:.2f} / {theirs['decode_tok_s']:.2f}",
                    _ratio(ratio["decode_speedup"]),
                    f"{roof['roofline_step_ms']:.0f}",
                    f"{roof['fraction']['ours']:.2f} / {roof['fraction'][side]:.2f}",
                    f"{identical}/{same['rows']}",
                ]
            )
    recompiled = [e["batch"] for e in result["results"] if e["ours"]["backend_compiles"]["timed"]]
    bandwidth = result["roofline"]["bandwidth"]["gb_s"]
    claim = (
        f"Greedy {result['new_tokens']} tokens of {result['model']} ({result['dtype']}, "
        f"{result['machine']['jax_backend']}): the same tokens as transformers in {identical_rows} of "
        f"{compared_rows} sequences compared; prefill / decode speed over transformers' "
        + ", ".join(f"{r[4]} / {r[6]} (batch {r[0]}, {r[2]} torch thread{'s' * (r[2] > 1)})" for r in rows)
        + f"; measured copy bandwidth {bandwidth:.1f} GB/s; compiles during the timed runs: "
        + ("none" if not recompiled else f"at batch {recompiled}")
        + "."
    )
    head = [
        "batch",
        "prompt tokens",
        "torch threads",
        "prefill tokens/s, ours / transformers",
        "prefill x",
        "decode tokens/s, ours / transformers",
        "decode x",
        "roofline step ms",
        "share of roofline, ours / transformers",
        "same greedy tokens",
    ]
    return _block(claim, _table(head, rows))


def bench_prefill(
    root: Path, files: Sequence[str] = ("results/bench_prefill.json", "results/bench_prefill_16k.json")
) -> str:
    """Chunked prefill against one pass, per (prompt length, method), from `pask-jax bench prefill` files."""
    rows, chunk = [], None
    for file in files:
        result = load_json(root, file)
        chunk = result["chunk"]
        for r in result["rows"]:
            c, o = r["chunked"], r["one_pass"]
            rows.append(
                [
                    r["prompt_tokens"],
                    r["method"],
                    f"{c['prefill_s']:.1f} / {o['prefill_s']:.1f}",
                    f"{c['tokens_per_s']:.0f} / {o['tokens_per_s']:.0f}",
                    f"{c['compile_s']:.1f} / {o['compile_s']:.1f}",
                    f"{c['xla_temp_mib']:.0f} / {o['xla_temp_mib']:.0f}",
                    f"{c['peak_rss_over_start_mib']:.0f} / {o['peak_rss_over_start_mib']:.0f}",
                    f"{c['peak_rss_mib']:.0f} / {o['peak_rss_mib']:.0f}",
                    f"{r['kept_agreement']:.4f}",
                    f"{r['logits_max_abs_diff']:.1e}",
                ]
            )
    longest = max(row[0] for row in rows)
    at_longest = [row for row in rows if row[0] == longest]

    def at(column: int) -> str:
        return "; ".join(f"{row[1]} {row[column]}" for row in at_longest)

    claim = (
        f"Prefill in chunks of {chunk} positions against one pass over the prompt (0.5B model, batch 1), at {longest} "
        f"tokens, chunked / one pass: seconds {at(2)}; XLA scratch MiB {at(5)}; peak resident memory over the "
        f"loaded model MiB {at(6)}. Kept entries agreeing between the two: at least "
        f"{min(float(row[8]) for row in rows):.4f} in every row."
    )
    head = [
        "prompt tokens",
        "method",
        "prefill s, chunked / one pass",
        "tokens/s",
        "compile s",
        "XLA temp MiB",
        "peak RSS over start MiB",
        "peak RSS MiB",
        "kept entries agreeing",
        "logits max abs diff",
    ]
    return _block(claim, _table(head, rows))


def bench_kernel(root: Path) -> str:
    result = load_json(root, "results/bench_kernel.json")
    rows = []
    for r in result["rows"]:
        interpret = r.get("kernel_interpret_over_dense")
        rows.append(
            [
                r["T"],
                f"{r['kept_fraction']:g}",
                r["kept_slots"],
                r["capacity"],
                f"{r['dense_ms']:.2f}",
                f"{r['compacted_over_dense']:.2f}",
                f"{r['ref_over_dense']:.2f}",
                f"{r['ref_ordered_over_dense']:.2f}",
                "-" if interpret is None else f"{interpret:.2f}",
            ]
        )
    by_t = {}
    for r in result["rows"]:
        by_t.setdefault(r["T"], []).append(f"{r['compacted_over_dense']:.2f}")
    fractions = " / ".join(f"{r['kept_fraction']:g}" for r in result["rows"] if r["T"] == result["rows"][0]["T"])
    shape = result["shape"]
    claim = (
        f"One decode step's attention (B = {shape['B']}, {shape['K_kv_heads']} KV heads x {shape['G_q_per_kv']} "
        f"query heads, head dim {shape['H_head_dim']}, {shape['dtype']}, {result['machine']['backend']}) over the "
        "budget-sized pool costs, "
        f"relative to dense attention over all T positions, at kept fractions {fractions}: "
        + "; ".join(f"{' / '.join(v)} at T = {t}" for t, v in by_t.items())
        + "."
    )
    head = [
        "T",
        "kept fraction",
        "kept slots",
        "capacity",
        "dense ms",
        "compacted pool x dense",
        "XLA gather, permuted table x dense",
        "XLA gather, ordered table x dense",
        "interpreted Pallas kernel x dense",
    ]
    return _block(claim, _table(head, rows))


def real_parity(root: Path, file: str = "results/real_parity.json") -> str:
    result = load_json(root, file)
    rows = [[i["id"], "yes" if i["identical"] else "no", i["first_divergence"] or "-"] for i in result["items"]]
    claim = (
        f"{result['model']} (GGUF): our engine and transformers' own GGUF load give identical greedy "
        f"{result['tokens']}-token outputs on {result['identical']} of {result['n']} BFCL prompts; the last prompt "
        f"token's logits differ by at most {result['max_abs_logit_diff_last_prompt_token']:.1e}."
    )
    return _block(claim, _table(["item", "identical", "first divergence"], rows))


def cache_bytes(root: Path) -> str:
    result = load_json(root, "results/cache_bytes.json")
    args = result["args"]
    rows = [[f"{r['budget']:g}", f"{r['bytes'] / 2**20:.1f}", f"{r['ratio_vs_full']:.4f}"] for r in result["rows"]]
    claim = (
        f"The KV cache the engine allocates for {args['batch']} prompts of {args['prompt_len']} tokens plus "
        f"{args['new_tokens']} new ones ({args['model']}) is "
        + " / ".join(r[2] for r in rows)
        + " of full KV's bytes at b = "
        + " / ".join(r[0] for r in rows)
        + "."
    )
    return _block(claim, _table(["b", "MiB", "x full KV"], rows))


# ---- JSON Schema suites: our grammar next to xgrammar and llguidance -------------------------------------------------

SCHEMA_SUITES = "results/bench_schemas.json"
SCHEMA_MASKS = "results/bench_schemas_masks.json"
SCHEMA_GENERATION = "results/bench_schemas_generation.json"
CONFORMANCE_SUITE = "draft2020-12"  # the JSON-Schema-Test-Suite part; every other suite is MaskBench's


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.2f}"


def schema_suites(root: Path, file: str = SCHEMA_SUITES) -> str:
    """Per suite and engine: compiled / refused / crashed / timeout, over- and under-constrained schemas, passing."""
    result = load_json(root, file)
    summary, engines = result["summary"], list(result["engines"])
    suites = [s for s in summary if s != "all"] + ["all"]
    head = ["suite", "engine", "schemas", "compiled", "refused", "crashed", "timeout", "over-constrained"]
    head += ["under-constrained", "passing", "compile ms, median", "compile s, total"]
    rows = []
    for suite in suites:
        for engine in engines:
            e = summary[suite][engine]
            rows.append([
                "**all**" if suite == "all" else suite, engine, e["schemas"], e["compiled"], e["refused"],
                e["crashed"], e["timeout"], e["over_constrained"], e["under_constrained"], e["passing"],
                _ms(e["compile_s"]["median"]), f"{e['compile_s']['total']:.2f}",
            ])  # fmt: skip
    maskbench = [s for s in summary if s not in ("all", CONFORMANCE_SUITE)]
    total = {
        engine: {k: sum(summary[s][engine][k] for s in maskbench) for k in ("schemas", "compiled", "passing")}
        for engine in engines
    }
    every = summary["all"]
    claim = (
        f"Of {every[engines[0]]['schemas']} schemas, passing (compiled, every instance judged right) "
        + ", ".join(f"{e} {every[e]['passing']}" for e in engines)
        + "; crashed "
        + ", ".join(f"{e} {every[e]['crashed']}" for e in engines)
        + f". On the {total[engines[0]]['schemas']} MaskBench schemas alone: passing "
        + ", ".join(f"{e} {total[e]['passing']}" for e in engines)
        + " (compiled "
        + " / ".join(str(total[e]["compiled"]) for e in engines)
        + ")."
    )
    return _block(claim, _table(head, rows))


def schema_masks(root: Path, file: str = SCHEMA_MASKS) -> str:
    """Mask time per token over a real tokenizer, per engine, and how often two engines allow the same tokens."""
    result = load_json(root, file)
    engines = list(result["engines"])
    compiled = {e: sum(r["engines"][e]["status"] == "compiled" for r in result["cases"]) for e in engines}
    head = ["engine", "schemas compiled", "masks", "mask us, median", "p90", "mean", "compile s, median"]
    rows = []
    for engine in engines:
        t, c = result["mask_time"][engine], result["compile_s"][engine]
        rows.append([
            engine, f"{compiled[engine]} of {len(result['cases'])}", t["n"], f"{t['median_us']:.1f}",
            f"{t['p90_us']:.1f}", f"{t['mean_us']:.1f}", f"{c['median_us'] / 1e6:.3f}" if c["n"] else "-",
        ])  # fmt: skip
    agree_head = ["engines", "states", "same tokens", "same but newline tokens", "Jaccard, mean", "Jaccard, min"]
    agree_rows = [
        [pair.replace("/", " / "), a["states"], _pct(a["equal_rate"]) + "%", _pct(a["equal_but_newlines_rate"]) + "%",
         f"{a['jaccard_mean']:.3f}", f"{a['jaccard_min']:.3f}"]
        for pair, a in result["agreement"].items()
    ]  # fmt: skip
    times = result["mask_time"]
    claim = (
        f"Over {result['tokenizer']}'s vocabulary, on {len(result['cases'])} tool-definition schemas, the median "
        "time to compute one token mask is " + ", ".join(f"{e} {times[e]['median_us']:.1f} us" for e in engines) + "."
    )
    return _block(claim, _table(head, rows), _table(agree_head, agree_rows))


def schema_generation(root: Path, file: str = SCHEMA_GENERATION) -> str:
    """Greedy constrained generation on suite schemas, per grammar backend: how many answers parse and validate."""
    result = load_json(root, file)
    head = ["model", "grammar backend", "schemas", "valid", "invalid", "unparsable", "refused", "hit the token limit"]
    rows, said = [], []
    for backend, run in result["backends"].items():
        s = run["summary"]
        rows.append([result["model"], backend, s["schemas"], s["valid"], s["invalid"], s["unparsable"], s["refused"]])
        rows[-1].append(s["hit_limit"])
        generated = s["schemas"] - s["refused"] - s["error"]
        said.append(f"{backend} {s['valid']} of {generated} answers validate ({s['refused']} schemas refused)")
    claim = (
        f"Greedy generation with {result['model']} on {rows[0][2]} schemas, at most {result['max_tokens']} tokens: "
        f"{'; '.join(said)}."
    )
    return _block(claim, _table(head, rows))


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


# ---- tool calls under auto ------------------------------------------------------------------------------------------

AUTO_REQUESTS = "examples/auto_requests.jsonl"
# the set's requests that need no call: a question no tool answers, or an answer the tool result already holds
NO_CALL_REQUESTS = frozenset(
    {"no-tool-fun-fact", "no-tool-arithmetic", "no-tool-sql-explain", "long-system-no-tool-baggage",
     "tool-result-answer-in-text"}
)  # fmt: skip
TOOL_CALL_RUNS = (  # (method, tool_choice, grammar, file)
    ("full KV", "auto", "text only", "results/auto/before_steering/full_auto.jsonl"),
    ("full KV", "auto", "steered", "results/auto/full_auto.jsonl"),
    ("full KV", "required", "", "results/auto/full_required.jsonl"),
    ("PASK, b = 0.33", "auto", "text only", "results/auto/before_steering/pask_auto.jsonl"),
    ("PASK, b = 0.33", "auto", "steered", "results/auto/pask_auto.jsonl"),
    ("PASK, b = 0.33", "auto", "steered, llguidance backend", "results/auto/pask_auto_llguidance.jsonl"),
    ("PASK, b = 0.33", "required", "", "results/auto/pask_required.jsonl"),
    ("SnapKV, b = 0.33", "auto", "text only", "results/auto/before_steering/snapkv_auto.jsonl"),
    ("SnapKV, b = 0.33", "auto", "steered", "results/auto/snapkv_auto.jsonl"),
    ("SnapKV, b = 0.33", "required", "", "results/auto/snapkv_required.jsonl"),
)


def _jsonl(root: Path, relative: str) -> list[dict]:
    path = root / relative
    if not path.is_file():
        raise ReportError(f"{relative}: no such results file")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tool_call_rates(root: Path) -> str:
    """Answers carrying `tool_calls` on the own request set, by method, tool_choice and the auto grammar, with the
    requests that need a call apart from those that need none; a call is schema-valid when `jsonschema` accepts its
    arguments against its tool's parameters."""
    tools = {
        line["custom_id"]: {t["function"]["name"]: t["function"].get("parameters", {}) for t in line["body"]["tools"]}
        for line in _jsonl(root, AUTO_REQUESTS)
    }
    need = len(tools.keys() - NO_CALL_REQUESTS)
    rows, rates = [], {}
    for method, choice, grammar, file in TOOL_CALL_RUNS:
        called, valid, calls = set(), 0, 0
        for line in _jsonl(root, file):
            message = line["response"]["body"]["choices"][0]["message"] if line.get("response") else {}
            for call in message.get("tool_calls") or []:
                called.add(line["custom_id"])
                schema = tools[line["custom_id"]].get(call["function"]["name"])
                calls += 1
                valid += schema is not None and jsonschema.Draft202012Validator(schema).is_valid(
                    json.loads(call["function"]["arguments"])
                )
        rates[(method, choice, grammar)] = len(called)
        rows.append([method, choice, grammar or "-", f"{len(called)} of {len(tools)}",
                     f"{len(called - NO_CALL_REQUESTS)} of {need}", f"{len(called & NO_CALL_REQUESTS)} of "
                     f"{len(NO_CALL_REQUESTS)}", f"{valid} of {calls}" if calls else "-"])  # fmt: skip
    claim = (
        f"Under `auto`, a call the model opens with {{ or a fence held to the schema (steered) takes PASK at b = 0.33 "
        f"from {rates[('PASK, b = 0.33', 'auto', 'text only')]} to {rates[('PASK, b = 0.33', 'auto', 'steered')]} "
        f"answers with tool calls of {len(tools)} (full KV {rates[('full KV', 'auto', 'text only')]} -> "
        f"{rates[('full KV', 'auto', 'steered')]}, SnapKV {rates[('SnapKV, b = 0.33', 'auto', 'text only')]} -> "
        f"{rates[('SnapKV, b = 0.33', 'auto', 'steered')]})."
    )
    head = ["method", "tool_choice", "auto grammar", "answers with tool_calls", "on requests needing a call",
            "on requests needing none", "schema-valid calls"]  # fmt: skip
    return _block(claim, _table(head, rows))


def prefill_compute(root: Path, file: str = "results/bench_prefill_flops.json") -> str:
    """A prefill's arithmetic rate against this machine's dense float32 matmul, from `pask-jax bench prefill`."""
    result = load_json(root, file)
    matmul = result["matmul_gflop_per_s"]
    rows = [
        [
            r["prompt_tokens"],
            r["method"],
            f"{r['model_gflop']:,.0f}",
            f"{r['chunked']['prefill_s']:.1f} / {r['one_pass']['prefill_s']:.1f}",
            f"{r['chunked']['gflop_per_s']:.0f} / {r['one_pass']['gflop_per_s']:.0f}",
            f"{r['chunked']['gflop_per_s'] / matmul:.2f} / {r['one_pass']['gflop_per_s'] / matmul:.2f}",
        ]
        for r in result["rows"]
    ]
    longest = max(result["rows"], key=lambda r: r["prompt_tokens"])
    best = max(longest["chunked"]["gflop_per_s"], longest["one_pass"]["gflop_per_s"])
    claim = (
        f"At {longest['prompt_tokens']} tokens {longest['method']}'s prefill computes {longest['model_gflop']:,.0f} "
        f"GFLOP at {best:.0f} GFLOP/s, {best / matmul:.2f} of this machine's float32 matmul rate ({matmul:.0f} "
        f"GFLOP/s on the MLP's shape): the same arithmetic at that rate would take {best / matmul:.2f} of its time."
    )
    head = ["prompt tokens", "method", "GFLOP", "seconds, chunked / one pass", "GFLOP/s", "of the matmul rate"]
    return _block(claim, _table(head, rows))


def short_dev_tables(name: str, files: tuple[str, ...]) -> dict[str, Callable[[Path], str]]:
    """`NAME_short_b02` and `NAME_short_b033`: the dev variants of `files` (BFCL's own dev prompts) at each budget."""
    return {
        f"{name}_short_b{b:g}".replace(".", ""): functools.partial(dev_tuning, tuning=Tuning(files, b))
        for b in (0.2, 0.33)
    }


TABLES: dict[str, Callable[[Path], str]] = {
    "bfcl_sweep_25": bfcl_sweep_25,
    "split_overlap": split_overlap,
    "overlap_pask_dapq": overlap_pask_dapq,
    "paired_b033": paired_b033,
    "versus_full": versus_full,
    "ablations_b033": ablations_b033,
    "dev_compiler": dev_compiler,
    "calibration_stats": calibration_stats,
    "calibration_own16_task_error": calibration_own16_task_error,
    "shipped_policy": shipped_policy,
    "serving_cpu_2k": serving_cpu_2k,
    "serving_cpu_bfcl": serving_cpu_bfcl,
    "serving_stream_cpu_bfcl64": serving_stream_cpu_bfcl64,
    "serving_stream_cpu_2k": serving_stream_cpu_2k,
    "serving_stream_cpu_bfcl64_b02": serving_stream_cpu_bfcl64_b02,
    "serving_grammar_overlap": serving_grammar_overlap,
    "bench_decode": bench_decode,
    "bench_decode_2k": functools.partial(bench_decode, file="results/bench_decode_2k.json"),
    "niah_qwen05b": niah_qwen05b,
    "niah_16k": functools.partial(niah_qwen05b, file="results/niah_16k_qwen2.5-coder-0.5b.json"),
    "niah_32k": functools.partial(niah_qwen05b, file="results/niah_32k_qwen2.5-coder-0.5b.json"),
    "niah_4k8k_shipped": functools.partial(niah_qwen05b, file="results/niah_4k8k_shipped_qwen2.5-coder-0.5b.json"),
    "niah_pooling_probe": niah_pooling_probe,
    "niah_floor_reach_dev": niah_floor_reach,
    "niah_dev_query_floors": functools.partial(niah_qwen05b, file="results/dev_v2/niah_dev_seed1_4k_query_floors.json"),
    "bench_kernel": bench_kernel,
    "bench_prefill": bench_prefill,
    "prefill_compute": prefill_compute,
    "real_parity": real_parity,
    "real_parity_1_5b": functools.partial(real_parity, file="results/real_parity_qwen2.5-coder-1.5b.json"),
    "cache_bytes": cache_bytes,
    "dev_tuning_b033": dev_tuning,
    "dev_tuning_long2k": functools.partial(dev_tuning, tuning=LONG_TUNING),
    "dev_b033_long_variant": functools.partial(
        dev_tuning, tuning=Tuning(("results/dev_tuning/dev_b033_long_variant.json",), TUNING_BUDGET)
    ),
    "schema_eval": schema_eval,
    "schema_paired": schema_paired,
    "schema_eval_1_5b": functools.partial(schema_eval, file=SCHEMA_EVAL_1_5B),
    "schema_paired_1_5b": functools.partial(schema_paired, file=SCHEMA_EVAL_1_5B),
    "schema_eval_budgets": functools.partial(schema_eval, file=SCHEMA_EVAL_BUDGETS),
    "schema_paired_budgets": functools.partial(schema_paired, file=SCHEMA_EVAL_BUDGETS),
    "schema_eval_b02_b033": functools.partial(schema_eval, file=SCHEMA_EVAL_B02),
    "schema_paired_b02_b033": functools.partial(schema_paired, file=SCHEMA_EVAL_B02),
    "readme_headline": readme_headline,
    "readme_default": readme_default,
    "long_prompts_2k_question_last": functools.partial(long_prompts, file="results/bfcl_long2k_question_last.json"),
    "long_prompts_2k_question_first": functools.partial(long_prompts, file="results/bfcl_long2k_question_first.json"),
    **{
        f"long_prompts_2k_fresh_{layout}": functools.partial(
            long_prompts, file=f"results/bfcl_long2k_fresh_{layout}.json", tuning=LONG_TUNING
        )
        for layout in LAYOUTS
    },
    "dev_tuning_v2_long2k": functools.partial(dev_tuning, tuning=V2_TUNING),
    "dev_query_floors_long2k": functools.partial(dev_tuning, tuning=QUERY_FLOORS_LONG),
    "dev_policy_regimes_long2k": functools.partial(dev_tuning, tuning=REGIMES_LONG),
    **short_dev_tables("dev_policy_regimes", REGIMES_SHORT),
    "dev_pask_queries_long2k": functools.partial(dev_tuning, tuning=QUERIES_LONG),
    **{
        f"long_prompts_2k_window_{layout}": functools.partial(long_prompts, file=file, tuning=WINDOW_TUNING)
        for layout, file in LONG_V3.items()
    },
    **short_dev_tables("dev_pask_queries", QUERIES_SHORT),
    "dev_pask_whole_tools_long2k": functools.partial(dev_tuning, tuning=WHOLE_TOOLS_LONG),
    **short_dev_tables("dev_pask_whole_tools", WHOLE_TOOLS_SHORT),
    "dev_held_out_long2k": dev_held_out,
    "dev_tuning_1_5b": functools.partial(dev_tuning, tuning=DEV_1_5B),
    "short_prompts_1_5b_every_baseline": functools.partial(long_prompts, file=SHORT_1_5B, tuning=DEV_1_5B),
    **{
        f"short_prompts_v2{part}": functools.partial(
            long_prompts, file=f"results/short_v2/bfcl_short_v2{part}.json", tuning=SHORT_V2_TUNING
        )
        for part in ("", "_items0_24", "_pooled", "_items85_109", "_pooled_all")
    },
    **{
        f"long_prompts_{name}": functools.partial(long_prompts, file=file, tuning=V2_TUNING)
        for name, file in LONG_V2.items()
    },
    "schema_suites": schema_suites,
    "schema_masks": schema_masks,
    "schema_generation": schema_generation,
    "tool_call_rates": tool_call_rates,
    "parallel_dev": parallel_dev,
}


# ---- the document ---------------------------------------------------------------------------------------------------


def table_blocks(doc: str) -> dict[str, str]:
    """NAME -> the text between a block's markers, checked: every opening marker closed, names known and unique."""
    blocks = {}
    for match in BLOCK.finditer(doc):
        name = match.group(1)
        if name not in TABLES:
            raise ReportError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        if name in blocks:
            raise ReportError(f"table {name!r} appears twice")
        blocks[name] = match.group(2)
    if len(MARKER_LINE.findall(doc)) != 2 * len(blocks):
        raise ReportError(f"unbalanced or malformed table markers (each block: `<!-- table:NAME -->` ... `{CLOSING}`)")
    return blocks


def render_tables(doc: str, root: Path) -> str:
    """`doc` with every table block rewritten from its results files; the text outside the blocks is kept."""
    table_blocks(doc)
    return BLOCK.sub(lambda m: f"<!-- table:{m.group(1)} -->\n{TABLES[m.group(1)](root)}\n{CLOSING}", doc)


def stale_tables(doc: str, root: Path, *, every_table: bool = True) -> list[str]:
    """Names of the blocks whose text differs from what their files give, then (with `every_table`) of the known
    tables `doc` lacks."""
    blocks = table_blocks(doc)
    stale = [name for name, text in blocks.items() if text != TABLES[name](root) + "\n"]
    return stale + ([f"{name} (missing)" for name in TABLES if name not in blocks] if every_table else [])


def stale_in_documents(docs: dict[str, str], root: Path) -> list[str]:
    """`stale_tables` over several documents (name -> text) that share the tables between them: each block checked
    where it stands, a table in two documents an error, one in none reported missing."""
    where: dict[str, str] = {}
    stale = []
    for doc_name, text in docs.items():
        for name in table_blocks(text):
            if name in where:
                raise ReportError(f"table {name!r} appears in both {where[name]} and {doc_name}")
            where[name] = doc_name
        stale += [f"{doc_name}: {name}" for name in stale_tables(text, root, every_table=False)]
    return stale + [f"{name} (missing)" for name in TABLES if name not in where]

"""The tables of docs/results/quantized.md: the quantized caches (KIVI, int8, PASK on int4 entries) against full KV
and against the eviction methods, on the BFCL items 110-134 that no run had scored, the budget in bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tools.report.common import _keys, _table, items_of, load_json, outcomes
from tools.report.serving import _serving
from tools.report.stats import PAIRED_HEAD, paired

# the four categories of the run over items 110-134, in the order they ran
QUANTIZED_EVAL = tuple(
    f"results/quantized_eval/bfcl_items110_134_{c}.json"
    for c in ("simple_python", "live_simple", "multiple", "live_multiple")
)
QUANTIZED = ("kivi", "int8", "fp8")  # the uniform quantizers: every entry stays, at low precision
ACTIONS_DEV = (  # PASK with precision actions on the dev split, beside the baselines on the same items
    "results/dev_actions/dev_calib6.json",
    "results/dev_actions/dev_calib18_short.json",
    "results/dev_actions/dev_calib18_keep_released.json",
    "results/dev_actions/dev_calib18_keep_released_b01_b033.json",
)
ACTIONS_DEV_MULTIPLE = (  # multiple: the baselines and the 17-item policy, releasing first or not
    "results/dev_actions/dev_calib18_multiple.json",
    "results/dev_actions/dev_calib18_keep_released_multiple.json",
)

ACTIONS_DEV_ALL = (  # every dev candidate on the 34 items of the three categories (rows run on all three)
    *ACTIONS_DEV,
    *ACTIONS_DEV_MULTIPLE,
    "results/dev_actions/dev_calib18_nll.json",
    "results/dev_actions/dev_kivi_residual.json",
    "results/dev_actions/dev_calib18_fill_window.json",
)


def _merged(root: Path, files: Sequence[str]) -> dict:
    """The runs of several single-category results files as one result."""
    return {"runs": [run for f in files for run in load_json(root, f)["runs"]]}


def _bytes(items: list[dict]) -> str:
    mean = sum(i["kv_bytes_ratio_mean"] for i in items) / len(items)
    return f"{mean:.3f} / {max(i['kv_bytes_ratio_max'] for i in items):.3f}"


def quantized_vs_full(root: Path, files: Sequence[str] = QUANTIZED_EVAL) -> str:
    result = _merged(root, files)
    full = outcomes(result, "full", 1.0)
    answered = [i for i, ok in full.items() if ok]
    rows, best = [], {}
    for method, budget in _keys(result):
        if method == "full":
            continue
        got = outcomes(result, method, budget)
        recall = sum(got[i] for i in answered) / len(answered)
        extra = sum(ok and not full[i] for i, ok in got.items())
        pair = paired(got, full)
        rows.append(
            [f"{method} @ {budget:g}", f"{pair.right_a} / {pair.items}", f"{100 * recall:.1f}", extra]
            + [_bytes(items_of(result, method, budget)), pair.difference, pair.p]
        )
        if method in QUANTIZED and recall > best.get(budget, ("", -1.0))[1]:
            best[budget] = (method, recall)
    head = ["method @ b", "correct", "% of full KV's correct", "correct where full KV is not"]
    head += ["bytes / full bf16, mean / max", "- full KV, points [95% CI]", "McNemar p"]
    cats = ", ".join(Path(f).stem.removeprefix("bfcl_items110_134_") for f in files)
    claim = (
        f"On BFCL items 110-134 of {cats} ({len(full)} items, none scored before), full KV answers {len(answered)}; "
        + "; ".join(
            f"at b = {b:g} the best uniform quantizer ({m}) answers {100 * r:.1f}% of them"
            for b, (m, r) in best.items()
        )
        + ". Budgets in bytes, metadata counted; the byte cap held at every step (max column)."
    )
    return f"**Claim.** {claim}\n\n" + _table(head, rows)


def quantized_vs_eviction(root: Path, files: Sequence[str] = QUANTIZED_EVAL) -> str:
    """Per budget, the quantizer with the most correct items against the eviction method with the most, paired."""
    result = _merged(root, files)
    rows = []
    for budget in sorted({b for m, b in _keys(result) if m != "full"}):
        correct = {m: sum(outcomes(result, m, b).values()) for m, b in _keys(result) if b == budget and m != "full"}
        quantizer = max((m for m in correct if m in QUANTIZED), key=correct.__getitem__)
        eviction = max((m for m in correct if m not in QUANTIZED), key=correct.__getitem__)
        rows.append(
            paired(outcomes(result, quantizer, budget), outcomes(result, eviction, budget)).row(
                f"{quantizer} - {eviction} @ {budget:g}"
            )
        )
    claim = "The best uniform quantizer against the best eviction method (bf16 or int4 entries) at each budget."
    return f"**Claim.** {claim}\n\n" + _table(("A - B @ b", *PAIRED_HEAD), rows)


def actions_dev(root: Path, files: Sequence[str] = ACTIONS_DEV) -> str:
    """Dev items: correct per category and in all, per method and budget, for the rows run on every category."""
    result = _merged(root, files)
    categories = list(dict.fromkeys(r["category"] for r in result["runs"]))
    rows = []
    for method, budget in sorted(_keys(result), key=lambda k: (k[1], k[0])):
        ran = {r["category"] for r in result["runs"] if (r["method"], r["budget"]) == (method, budget)}
        if ran < set(categories):
            continue
        got = outcomes(result, method, budget)
        per = [sum(outcomes(result, method, budget, [c]).values()) for c in categories]
        bytes_ = _bytes(items_of(result, method, budget))
        rows.append([f"{method} @ {budget:g}", *per, f"{sum(got.values())} / {len(got)}", bytes_])
    labels = {
        "pask:v3": "PASK under the 6-item precision-action policy, RELEASE buckets leaving first",
        "pask:v18": "PASK under the 17-item precision-action policy, RELEASE buckets leaving first "
        "(`pask:release_first`)",
        "pask:keep_released": "the 17-item policy under the default rule, RELEASE buckets going down to 2 bits with "
        "the rest",
        "pask:nll": "the same with the knapsack valued by the NLL change (`--value nll`)",
        "pask:fill_window": "the default rule with `fill_window`",
        "kivi:r32": "KIVI with a full-precision window of 32 (`kivi:r64`: 64; `kivi`: 128)",
        "pask:actions": "the 17-item policy under the default rule",
    }
    present = {row[0].split(" @ ")[0] for row in rows}  # the methods with a row
    claim = (
        f"Dev items only (for choosing, not a reported result): the first 12 dev items of {', '.join(categories)}, "
        "every row on the same items. "
        + "; ".join(f"`{m}`: {text}" for m, text in labels.items() if m in present)
        + "."
    )
    head = ["method @ b", *categories, "all", "bytes / full bf16, mean / max"]
    return f"**Claim.** {claim}\n\n" + _table(head, rows)


def actions_dev_multiple(root: Path) -> str:
    return actions_dev(root, ACTIONS_DEV_MULTIPLE)


def actions_dev_all(root: Path) -> str:
    return actions_dev(root, ACTIONS_DEV_ALL)


def actions_dev_prefill_rule(root: Path) -> str:
    return actions_dev(root, ("results/dev_actions/dev_prefill_rule.json",))


def quantized_serving(root: Path) -> str:
    return _serving(root, "results/quantized_eval/serving_storage.json")


TABLES: dict[str, Callable[[Path], str]] = {
    "quantized_vs_full": quantized_vs_full,
    "quantized_vs_eviction": quantized_vs_eviction,
    "quantized_serving": quantized_serving,
    "actions_dev": actions_dev,
    "actions_dev_multiple": actions_dev_multiple,
    "actions_dev_all": actions_dev_all,
    "actions_dev_prefill_rule": actions_dev_prefill_rule,
}

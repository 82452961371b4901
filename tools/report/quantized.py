"""The tables of docs/results/quantized.md: the quantized caches (KIVI, int8, PASK on int4 entries) against full KV
and against the eviction methods, on the BFCL items 110-134 that no run had scored, the budget in bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tools.report.common import _keys, _table, items_of, load_json, outcomes
from tools.report.serving import _serving
from tools.report.stats import PAIRED_HEAD, paired

QUANTIZED_SAMPLE = "results/quantized_eval/bfcl_items110_134_"  # + category (+ "_more": run_more.sh's rows) + .json
# the four categories of the run over items 110-134, in the order they ran; fp8 and StreamingLLM ran on all four
# (run_more.sh, beside run.sh's rows)
QUANTIZED_MORE = ("simple_python", "live_simple", "multiple", "live_multiple")
QUANTIZED_EVAL = tuple(f"{QUANTIZED_SAMPLE}{c}.json" for c in QUANTIZED_MORE)
QUANTIZED_EVAL_MORE = tuple(f"{QUANTIZED_SAMPLE}{c}{more}.json" for c in QUANTIZED_MORE for more in ("", "_more"))
QUANTIZED = ("kivi", "int8", "fp8")  # the uniform quantizers: every entry stays, at low precision
# the frozen evaluation of PASK with precision actions over items 160-184: per category a file of full KV and PASK v2
# (`base`) and one of PASK v3 and KIVI (`v3`); the categories whose run is complete, in the order they ran
ACTIONS_EVAL = tuple(
    f"results/actions_eval/bfcl_items160_184_{c}_{group}.json"
    for c in ("simple_python", "live_simple", "live_multiple")
    for group in ("base", "v3")
)
# KIVI at its widest precision with i16 positions (4 bits at b = 0.33) over items 185-209: per category a file of
# full KV and KIVI (run.sh) and one of the default PASK (run_more.sh), the categories whose runs are complete
KIVI_EVAL = tuple(
    f"results/kivi_eval/bfcl_items185_209_{c}{more}.json"
    for c in ("simple_python", "live_simple", "live_multiple")
    for more in ("", "_more")
)
KIVI_DEV = ("results/dev_positions/dev_kivi_i16.json",)  # the same KIVI on the 34 dev items, before the run
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
    "results/dev_actions/dev_kivi_uncapped.json",
    "results/dev_actions/dev_calib8_low4.json",
    "results/dev_actions/dev_two_pools.json",
    "results/dev_actions/dev_kivi4_capped.json",
    "results/dev_actions/dev_two_pools_window.json",
    "results/dev_actions/dev_small_high.json",
)


def _merged(root: Path, files: Sequence[str]) -> dict:
    """The runs of several single-category results files as one result."""
    return {"runs": [run for f in files for run in load_json(root, f)["runs"]]}


def _bytes(items: list[dict]) -> str:
    mean = sum(i["kv_bytes_ratio_mean"] for i in items) / len(items)
    return f"{mean:.3f} / {max(i['kv_bytes_ratio_max'] for i in items):.3f}"


def recall(got: dict[str, bool], full: dict[str, bool]) -> float:
    """The share of the items full KV answers that `got` answers too."""
    answered = [i for i, ok in full.items() if ok]
    return sum(got[i] for i in answered) / len(answered)


def most_correct(result: dict, budget: float, among: Callable[[str], bool]) -> tuple[str, int]:
    """The compressed method (`among`: a method-name test; never full KV) with the most correct items at `budget`,
    the first run on a tie, and its count."""
    correct = {
        m: sum(outcomes(result, m, b).values()) for m, b in _keys(result) if b == budget and m != "full" and among(m)
    }
    best = max(correct, key=correct.__getitem__)
    return best, correct[best]


def _vs_full(result: dict, sample: str, leaders: Callable[[str], bool], leader_kind: str) -> str:
    """Every (method, budget) against full KV on the same items: correct, the recall of full KV's correct set, the
    items full KV misses, bytes, the paired difference and McNemar p; the claim names, per budget, the row of
    `leaders` (a method-name test) with the highest recall."""
    full = outcomes(result, "full", 1.0)
    answered = [i for i, ok in full.items() if ok]
    rows, best = [], {}
    for method, budget in _keys(result):
        if method == "full":
            continue
        got = outcomes(result, method, budget)
        share = recall(got, full)
        extra = sum(ok and not full[i] for i, ok in got.items())
        pair = paired(got, full)
        rows.append(
            [f"{method} @ {budget:g}", f"{pair.right_a} / {pair.items}", f"{100 * share:.1f}", extra]
            + [_bytes(items_of(result, method, budget)), pair.difference, pair.p]
        )
        if leaders(method) and share > best.get(budget, ("", -1.0))[1]:
            best[budget] = (method, share)
    head = ["method @ b", "correct", "% of full KV's correct", "correct where full KV is not"]
    head += ["bytes / full bf16, mean / max", "- full KV, points [95% CI]", "McNemar p"]
    claim = (
        f"On {sample} ({len(full)} items, none scored before), full KV answers {len(answered)}; "
        + "; ".join(f"at b = {b:g} {leader_kind} ({m}) answers {100 * r:.1f}% of them" for b, (m, r) in best.items())
        + ". Budgets in bytes, metadata counted; the byte cap held at every step (max column)."
    )
    return f"**Claim.** {claim}\n\n" + _table(head, rows)


def _categories(files: Sequence[str], prefix: str) -> str:
    """The categories of per-category results files, in order (a category's several files named once)."""
    return ", ".join(
        dict.fromkeys(
            Path(f).stem.removeprefix(prefix).removesuffix("_base").removesuffix("_v3").removesuffix("_more")
            for f in files
        )
    )


def quantized_vs_full(root: Path, files: Sequence[str] = QUANTIZED_EVAL) -> str:
    sample = f"BFCL items 110-134 of {_categories(files, Path(QUANTIZED_SAMPLE).name)}"
    return _vs_full(_merged(root, files), sample, QUANTIZED.__contains__, "the best uniform quantizer")


def quantized_more_vs_full(root: Path, files: Sequence[str] = QUANTIZED_EVAL_MORE) -> str:
    sample = f"BFCL items 110-134 of {_categories(files, Path(QUANTIZED_SAMPLE).name)}"
    return _vs_full(_merged(root, files), sample, QUANTIZED.__contains__, "the best uniform quantizer")


def quantized_vs_eviction(
    root: Path, files: Sequence[str] = QUANTIZED_EVAL, evictions: str = "bf16 or int4 entries"
) -> str:
    """Per budget, the quantizer with the most correct items against the eviction method with the most, paired;
    `evictions` says in the claim which eviction rows ran."""
    result = _merged(root, files)
    rows = []
    for budget in sorted({b for m, b in _keys(result) if m != "full"}):
        quantizer, _ = most_correct(result, budget, QUANTIZED.__contains__)
        eviction, _ = most_correct(result, budget, lambda m: m not in QUANTIZED)
        rows.append(
            paired(outcomes(result, quantizer, budget), outcomes(result, eviction, budget)).row(
                f"{quantizer} - {eviction} @ {budget:g}"
            )
        )
    claim = f"The best uniform quantizer against the best eviction method ({evictions}) at each budget."
    return f"**Claim.** {claim}\n\n" + _table(("A - B @ b", *PAIRED_HEAD), rows)


def kivi_eval_vs_full(root: Path, files: Sequence[str] = KIVI_EVAL) -> str:
    sample = f"BFCL items 185-209 of {_categories(files, 'bfcl_items185_209_')}"
    return _vs_full(_merged(root, files), sample, QUANTIZED.__contains__, "KIVI at its widest precision")


def kivi_eval_vs_eviction(root: Path) -> str:
    return quantized_vs_eviction(root, KIVI_EVAL, "the default PASK, bf16 entries")


def actions_eval_vs_full(root: Path, files: Sequence[str] = ACTIONS_EVAL) -> str:
    sample = f"BFCL items 160-184 of {_categories(files, 'bfcl_items160_184_')}"
    return _vs_full(_merged(root, files), sample, "pask:v3".__eq__, "PASK with precision actions")


def actions_eval_vs_strongest(root: Path, files: Sequence[str] = ACTIONS_EVAL) -> str:
    """Per budget, PASK with precision actions against the other compressed row with the most correct items."""
    result = _merged(root, files)
    rows = []
    for budget in sorted({b for m, b in _keys(result) if m != "full"}):
        other, _ = most_correct(result, budget, lambda m: m != "pask:v3")
        pair = paired(outcomes(result, "pask:v3", budget), outcomes(result, other, budget))
        rows.append(pair.row(f"pask:v3 - {other} @ {budget:g}"))
    claim = "PASK with precision actions against the strongest other compressed row at each budget, item by item."
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
        "kivi:k2": "KIVI at 2 bits without a cap (b = 1; `kivi` at b = 1 takes 4 bits)",
        "pask:low4": "precision actions with KIVI-4 as LOW, under an 8-item policy calibrated at KIVI-4",
        "pask:two_pools": "precision actions over two block pools (HIGH 4 bits, LOW 2 bits, a full-precision window "
        "of 32), under the 17-item policy compiled from its KIVI-2 and KIVI-4 calibrations",
        "kivi:k4": "KIVI at 4 bits under the cap (the oldest entries leave; `kivi` takes 2 bits at b <= 0.33)",
        "pask:two_pools_w": "the same with the window's bytes set aside in the compile (`--window 32`) and a mixed "
        "window block moved down to 2 bits rather than anything evicted",
        "pask:small_high": "the two pools with the method config's own actions over that policy's floors and "
        "priorities: the call being written, the request and the tools' names at 4 bits, every other role at 2 bits, "
        "nothing released by the plan",
        "pask:actions": "the 17-item policy under the default rule",
    }
    present = {row[0].split(" @ ")[0] for row in rows}  # the methods with a row
    named = "; ".join(f"`{m}`: {text}" for m, text in labels.items() if m in present)
    claim = (
        f"Dev items only (for choosing, not a reported result): the first 12 dev items of {', '.join(categories)}, "
        "every row on the same items." + (f" {named}." if named else "")
    )
    head = ["method @ b", *categories, "all", "bytes / full bf16, mean / max"]
    return f"**Claim.** {claim}\n\n" + _table(head, rows)


def actions_dev_multiple(root: Path) -> str:
    return actions_dev(root, ACTIONS_DEV_MULTIPLE)


def actions_dev_all(root: Path) -> str:
    return actions_dev(root, ACTIONS_DEV_ALL)


def kivi_dev(root: Path) -> str:
    return actions_dev(root, KIVI_DEV)


def actions_dev_prefill_rule(root: Path) -> str:
    return actions_dev(root, ("results/dev_actions/dev_prefill_rule.json",))


def quantized_serving(root: Path) -> str:
    return _serving(root, "results/quantized_eval/serving_storage.json")


TABLES: dict[str, Callable[[Path], str]] = {
    "quantized_vs_full": quantized_vs_full,
    "quantized_vs_eviction": quantized_vs_eviction,
    "quantized_more_vs_full": quantized_more_vs_full,
    "quantized_serving": quantized_serving,
    "kivi_dev": kivi_dev,
    "kivi_eval_vs_full": kivi_eval_vs_full,
    "kivi_eval_vs_eviction": kivi_eval_vs_eviction,
    "actions_eval_vs_full": actions_eval_vs_full,
    "actions_eval_vs_strongest": actions_eval_vs_strongest,
    "actions_dev": actions_dev,
    "actions_dev_multiple": actions_dev_multiple,
    "actions_dev_all": actions_dev_all,
    "actions_dev_prefill_rule": actions_dev_prefill_rule,
}

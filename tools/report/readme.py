"""The tables of the README: the default PASK on its frozen evaluation samples, both models, against full KV and the
strongest baseline row; the best uniform quantizer at byte budgets against full KV and the default PASK."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from tools.report.common import _block, _keys, _table, outcomes
from tools.report.frozen import (
    DEV_1_5B,
    LONG_V2,
    SHORT_1_5B,
    SHORT_V2_TUNING,
    V2_TUNING,
    Tuning,
    _frozen_eval,
    _scored_budgets,
    _strongest_baseline,
)
from tools.report.quantized import KIVI_EVAL, QUANTIZED, QUANTIZED_EVAL_MORE, _merged, most_correct, recall
from tools.report.stats import paired


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


QUANTIZED_SAMPLES = (  # (the items and their number, the files of every row run on them)
    ("110-134 (100)", QUANTIZED_EVAL_MORE),
    ("185-209 (75)", KIVI_EVAL),
)


def readme_quantized(root: Path) -> str:
    """The README's table of the quantized caches: per fresh sample and budget, full KV, the uniform quantizer with
    the most correct items (its recall of full KV's correct set and its paired difference) and the default PASK."""
    rows = []
    for items, files in QUANTIZED_SAMPLES:
        result = _merged(root, files)
        full = outcomes(result, "full", 1.0)
        for budget in sorted({b for m, b in _keys(result) if m != "full"}, reverse=True):
            best, correct = most_correct(result, budget, QUANTIZED.__contains__)
            got = outcomes(result, best, budget)
            pair = paired(got, full)
            rows.append(
                [items, f"{budget:g}", sum(full.values()), f"{best} {correct}", f"{100 * recall(got, full):.1f}",
                 sum(outcomes(result, "pask", budget).values()), f"{pair.difference}, p = {pair.p}"]
            )  # fmt: skip
    claim = (
        "The best uniform quantizer on fresh BFCL items (0.5B, b in bytes, metadata counted) beside full KV and the "
        "default PASK; KIVI: 2 bits at 0.33 on 110-134 (i32 positions then), 4 on 185-209."
    )
    head = ["BFCL items", "b", "full KV", "best quantizer", "% of full KV's correct", "PASK",
            "quantizer - full KV"]  # fmt: skip
    return _block(claim, _table(head, rows))


TABLES: dict[str, Callable[[Path], str]] = {
    "readme_default": readme_default,
    "readme_quantized": readme_quantized,
}

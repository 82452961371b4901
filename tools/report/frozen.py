"""The schema split's frozen methods, which several documents report: every method's variant chosen on dev items by
one rule (``Tuning``), frozen, then scored on evaluation items; the tables that render dev grids (``dev_tuning``),
frozen evaluations (``schema_eval``, ``schema_paired``) and prompts with their paired comparisons (``long_prompts``),
and the tunings and samples more than one document reads."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.protocol import choose_variants, dev_totals, method_of
from tools.report.common import (
    ReportError,
    _block,
    _keys,
    _pct,
    _runs,
    _table,
    category_scores,
    items_of,
    load_json,
    outcomes,
)
from tools.report.stats import PAIRED_HEAD, _paired_row

DEV_TUNING = "results/dev_tuning/dev_b033.json"
SCHEMA_EVAL = "results/bfcl_schema_eval.json"
SCHEMA_EVAL_1_5B = "results/bfcl_schema_eval_qwen2.5-coder-1.5b.json"  # section 1's frozen methods, 1.5B
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
DEV_1_5B = Tuning(("results/dev_1_5b/dev_b033.json",), TUNING_BUDGET)  # the 1.5B model's own dev grid
SHORT_1_5B = "results/bfcl_1_5b_v2/bfcl_1_5b_v2.json"  # its frozen sample, every baseline at its dev choice
LONG_V2 = {  # the frozen PASK v2's long-prompt tables: name -> results file (tuned by V2_TUNING)
    "2k_v2_question_last": "results/long_v2/bfcl_long2k_v2_budgets_question_last.json",  # b = 0.2, 0.1 / 0.33 merged in
    "2k_v2_question_first": "results/long_v2/bfcl_long2k_v2_budgets_question_first.json",  # the same, question first
    "2k_v2_1_5b_question_last": "results/long_v2/bfcl_long2k_v2_1_5b_question_last.json",
    "2k_v2_1_5b_question_first": "results/long_v2/bfcl_long2k_v2_1_5b_question_first.json",
    "4k_v2_question_last": "results/long_v2/bfcl_long4k_v2_question_last.json",
    "4k_v2_question_first": "results/long_v2/bfcl_long4k_v2_question_first.json",
}
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

"""The tables of docs/results/schemas.md, JSON Schema suites we did not write: our grammar next to xgrammar and
llguidance on coverage, per-token mask time and token-set agreement, and greedy constrained generation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tools.report.common import _block, _pct, _table, load_json

SCHEMA_SUITES = "results/bench_schemas.json"
SCHEMA_SUITES_LARGE = "results/bench_schemas_large.json"  # every draft2020-12 group, 1,345 MaskBench schemas
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


def schema_suites_large(root: Path) -> str:
    return schema_suites(root, SCHEMA_SUITES_LARGE)


TABLES: dict[str, Callable[[Path], str]] = {
    "schema_suites": schema_suites,
    "schema_suites_large": schema_suites_large,
    "schema_masks": schema_masks,
    "schema_generation": schema_generation,
}

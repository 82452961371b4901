"""Schema coverage on suites we did not write: our grammar next to xgrammar and llguidance, on the same schemas.

    pask-jax bench schemas [--suites tests/data/schema_suites] [--engines pask,xgrammar,llguidance]
                           [--timeout 120] [--out results/bench_schemas.json]
    pask-jax bench schemas --tokenizer qwen2.5-coder-0.5b [--sample 40] [--out results/bench_schemas_masks.json]
    pask-jax bench schemas --generate smollm2-135m [--sample 24] [--max-tokens 256] [--grammar-backends B1,B2]
                           [--out results/bench_schemas_generation.json]

The second form measures per-token mask time and token-set agreement over a real tokenizer (``schema_masks``), the
third greedy constrained generation with a small model (``schema_generation``); both on a sample of MaskBench's
tool-definition schemas. What follows is the first form, coverage.

The suites are the pinned subsets ``scripts/build_schema_suites.py`` writes (JSON-Schema-Test-Suite draft2020-12,
JSON-Schema-Bench MaskBench): real schemas, each with instances labelled valid or invalid. For every schema and
engine:

- **compiled**, **refused** (the engine says it cannot: for ``pask`` a ``GrammarError`` from ``enforced_schema`` /
  the regex / the outlines-core Index, as ``compile_json_grammar`` raises it, grouped by the keyword its message
  names), **crashed** (``pask``: any other exception, a defect; a peer: its worker process died) or **timeout**;
- for a compiled schema, each instance walked through the automaton: a valid instance rejected is
  **over-constraint**, an invalid one accepted **under-constraint**; **passing** is MaskBench's measure (compiled,
  every instance judged right).

``pask`` is the grammar of a ``response_format`` turn (``enforced_schema`` -> ``json_regex``, the tight whitespace
``[ ]?``), compiled by outlines-core over a vocabulary of the 256 single bytes (which spells every byte string, so
the byte strings it accepts are the ones the token-level grammar accepts) and walked byte by byte, then the
end-of-turn marker, ending in a final state. xgrammar (``compile_json_schema`` defaults: any whitespace, strict
mode) and llguidance (``grammar_from_json_schema`` defaults) get the same byte vocabulary and must accept the whole
text and then the end. Compile seconds are therefore automaton construction: over a real tokenizer's vocabulary
each engine adds its token-mask precomputation (for outlines-core the larger part, ~1 s per schema for Qwen).

**Serialization.** An instance is written as ``json.dumps(data, ensure_ascii=False)`` (MaskBench's choice; the
``", "`` / ``": "`` separators are inside every engine's whitespace) as given and, when that differs, with each
object's keys reordered into declaration order (the keys of ``properties``, following ``$ref`` / ``allOf`` /
``anyOf`` / ``oneOf``, then the others in their order): every engine here writes properties in declaration order,
and key order never changes validity. An instance counts as accepted when either text is.

``pask`` is the default (strict) translation: a schema with a constraint it does not enforce (LOOSENED in
``SCHEMA_KEYWORDS``: ``multipleOf``, ``uniqueItems``, an overlapping ``oneOf``, a format other than
``ENFORCED_FORMATS``) is refused, as ``KEYWORD (not enforced)``. Each invalid instance it still accepts is explained
by ``jsonschema`` (its failing keywords): **loosened** when one of them is a LOOSENED keyword, **enforced** otherwise
(a keyword the table says the grammar enforces let a wrong value through: a defect), **unexplained** when
jsonschema finds the instance valid (it checks no ``uri`` or ``date-time`` format without ``rfc3987`` /
``rfc3339-validator``). Each
engine runs in its own worker process (a timeout or a crash there does not end the run); `--timeout` is per schema.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pask_jax.arguments import grammar_backend
from pask_jax.experiments.bench.schema_generation import generation_cases, run_generation
from pask_jax.experiments.bench.schema_masks import MASK_ENGINES, TOOL_SUBSETS, run_masks, sample_cases
from pask_jax.experiments.bench.schema_suites import (
    COMPILED,
    CRASHED,
    REFUSED,
    TIMEOUT,
    Case,
    Refused,
    Worker,
    answer_tasks,
    failing_keywords,
    load_suites,
    serializations,
    suite_files,
)
from pask_jax.structure.regex import json_regex
from pask_jax.structure.schema import ENFORCED_FORMATS, LOOSENED, SCHEMA_KEYWORDS, GrammarError
from pask_jax.structure.schema_rewrite import enforced_schema

ENGINES = ("pask", "xgrammar", "llguidance")
PACKAGES = {"pask": "outlines-core", "xgrammar": "xgrammar", "llguidance": "llguidance"}
DEFAULT_SUITES = Path("tests/data/schema_suites")
BYTE_EOS = 256  # the end-of-text token after the 256 single-byte tokens
END_OF_TURN = b"\x04"  # the marker byte our regexes end with (vocabulary.END_OF_TURN)


# ---------------------------------------------------------------------------------------------------------------
# Engines: compile(schema) -> accepts(text) or raise Refused; run in a worker process


_REFUSAL_RULES = (  # (pattern over our GrammarError message, label); the first match names the refusal
    (r"'format' '([^']+)' is not enforced", r"format:\1 (not enforced)"),
    (r"keyword '([^']+)' is not enforced", r"\1 (not enforced)"),
    (r"unknown keyword '([^']+)'", r"\1 (unknown)"),
    (r"keyword '([^']+)' is refused", r"\1"),
    (r"keyword '([^']+)' with sibling keywords", r"\1 with siblings"),
    (r"'(enum|const)' with \[", r"\1 with siblings"),
    (r"'allOf' of several schemas", "allOf of several"),
    (r"required \[.*\] are not among its properties", "required not in properties"),
    (r"'(\w+)' must be a non-negative integer", r"\1 not an integer"),
    (r"'items' as a list", "items as a list"),
    (r"\$ref '[^']*': only local", "$ref not local"),
    (r"\$ref '[^']*' points at nothing", "$ref unresolved"),
    (r"outlines-core cannot build a regex", "outlines-core regex"),
    (r"outlines-core cannot compile", "outlines-core Index"),
    (r"no value satisfies|no \w+ value has", "unsatisfiable"),
    (r"'(\$?\w+)'", r"\1"),
)


def refusal_keyword(message: str) -> str:
    """What a GrammarError message names: the keyword (or construct) the grammar refused."""
    detail = message.partition("': ")[2] or message
    for pattern, label in _REFUSAL_RULES:
        match = re.search(pattern, detail)
        if match:
            return match.expand(label)
    return "other"


def _pask() -> Callable[[Any], Callable[[bytes], bool]]:
    from outlines_core import Index, Vocabulary

    vocabulary = Vocabulary(BYTE_EOS, {bytes([i]): [i] for i in range(256)})

    def compile_schema(schema: Any) -> Callable[[bytes], bool]:
        try:
            regex = json_regex(enforced_schema(schema, "response_format"))
        except GrammarError as exc:
            raise Refused(refusal_keyword(str(exc)), str(exc)) from exc
        try:
            index = Index(regex, vocabulary)
        except Exception as exc:  # compile_json_grammar turns this into its GrammarError
            raise Refused("outlines-core Index", f"outlines-core cannot compile the regex ({exc})") from exc
        final = frozenset(index.get_final_states())

        def accepts(text: bytes) -> bool:
            state = index.get_initial_state()
            for byte in text + END_OF_TURN:
                state = index.get_next_state(state, byte)
                if state is None:
                    return False
            return state in final

        return accepts

    return compile_schema


def _xgrammar() -> Callable[[Any], Callable[[bytes], bool]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"<eos>"], stop_token_ids=[BYTE_EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(schema: Any) -> Callable[[bytes], bool]:
        try:
            grammar = compiler.compile_json_schema(json.dumps(schema))
        except Exception as exc:  # "[time] /project/cpp/json_schema_converter.cc:4944: Unsupported type ..."
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc))
            raise Refused(message.splitlines()[0][:60], message) from exc

        def accepts(text: bytes) -> bool:
            matcher = xgr.GrammarMatcher(grammar)
            return matcher.accept_string(text) and matcher.accept_token(BYTE_EOS) and matcher.is_terminated()

        return accepts

    return compile_schema


class _ByteTokenizer:
    """The 256 single bytes and an end-of-text token, as llguidance's ``TokenizerWrapper`` wants a tokenizer."""

    eos_token_id, bos_token_id, special_token_ids = BYTE_EOS, None, [BYTE_EOS]
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _llguidance() -> Callable[[Any], Callable[[bytes], bool]]:
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    tokenizer = LLTokenizer(TokenizerWrapper(_ByteTokenizer()))

    def compile_schema(schema: Any) -> Callable[[bytes], bool]:
        try:
            matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_json_schema(schema), log_level=0)
        except Exception as exc:
            raise Refused(type(exc).__name__, str(exc)) from exc
        if matcher.is_error():
            error = matcher.get_error()
            raise Refused(error.splitlines()[0][:60], error)

        def accepts(text: bytes) -> bool:
            run = matcher.deep_copy()
            return run.consume_tokens(list(text)) and run.is_accepting()

        return accepts

    return compile_schema


_FACTORIES = {"pask": _pask, "xgrammar": _xgrammar, "llguidance": _llguidance}


def judge(compile_schema: Callable[[Any], Callable[[bytes], bool]], schema: Any, texts: list[list[bytes]]) -> dict:
    """One schema through one engine: its status, compile seconds and, compiled, whether each instance is accepted
    (``texts``: each instance's serializations). Exceptions other than Refused propagate (a crash)."""
    start = time.perf_counter()
    try:
        accepts = compile_schema(schema)
    except Refused as exc:
        return {"status": REFUSED, "keyword": exc.keyword, "message": str(exc)[:300]}
    compile_s = time.perf_counter() - start
    return {"status": COMPILED, "compile_s": compile_s, "accepted": [any(map(accepts, each)) for each in texts]}


def _serve(engine: str, conn) -> None:
    """Worker process: (schema, texts) in, judge()'s dict out; any other exception is a crash, reported."""
    compile_schema = _FACTORIES[engine]()
    answer_tasks(conn, lambda *task: judge(compile_schema, *task))


# ---------------------------------------------------------------------------------------------------------------
# Explaining pask's under-constraints


def loosened(keyword: str) -> bool:
    """Whether SCHEMA_KEYWORDS documents ``keyword`` (``format:NAME`` for a format) as not enforced."""
    if keyword.startswith("format:"):
        return keyword.partition(":")[2] not in ENFORCED_FORMATS
    return SCHEMA_KEYWORDS.get(keyword, ("",))[0] == LOOSENED


def explain_under(schema: Any, data: Any) -> dict:
    """Why an invalid instance the grammar accepted got through: loosened / enforced / unexplained, with keywords."""
    keywords = failing_keywords(schema, data)
    kind = "unexplained" if not keywords else "loosened" if any(map(loosened, keywords)) else "enforced"
    return {"kind": kind, "keywords": keywords}


# ---------------------------------------------------------------------------------------------------------------
# The run


def judge_all(cases: list[Case], engines: tuple[str, ...], timeout: float, progress: bool = True) -> list[dict]:
    """Every case through every engine -> one row per case with each engine's verdict."""
    texts = [[serializations(t["data"], case.schema) for t in case.tests] for case in cases]
    rows = [{"suite": c.suite, "id": c.id, "tests": len(c.tests), "engines": {}} for c in cases]
    for engine in engines:
        worker = Worker(engine, _serve)
        try:
            for i, (case, row) in enumerate(zip(cases, rows, strict=True)):
                row["engines"][engine] = verdict(case, worker.ask((case.schema, texts[i]), timeout), engine)
                if progress and (i + 1) % 50 == 0:
                    print(f"{engine}: {i + 1}/{len(cases)}", flush=True)
        finally:
            worker.stop()
    return rows


def verdict(case: Case, result: dict, engine: str) -> dict:
    """judge()'s dict -> the row entry: over- / under-constrained instance indices (pask: under explained)."""
    if result["status"] != COMPILED:
        return result
    accepted = result.pop("accepted")
    result["compile_s"] = round(result["compile_s"], 5)
    result["over"] = [i for i, (t, ok) in enumerate(zip(case.tests, accepted, strict=True)) if t["valid"] and not ok]
    result["under"] = [i for i, (t, ok) in enumerate(zip(case.tests, accepted, strict=True)) if not t["valid"] and ok]
    if engine == "pask" and result["under"]:
        result["under_explained"] = [explain_under(case.schema, case.tests[i]["data"]) for i in result["under"]]
    return result


def summarize(rows: list[dict], engines: tuple[str, ...]) -> dict:
    """Per suite (and "all") and engine: counts of each status, refusals by keyword, instance errors, seconds."""
    suites: dict[str, list[dict]] = {"all": rows}
    for row in rows:
        suites.setdefault(row["suite"], []).append(row)
    out: dict = {}
    for suite, members in suites.items():
        out[suite] = {}
        for engine in engines:
            verdicts = [(row, row["engines"][engine]) for row in members]
            compiled = [(row, v) for row, v in verdicts if v["status"] == COMPILED]
            seconds = sorted(v["compile_s"] for _, v in compiled)
            entry = {
                "schemas": len(verdicts),
                **{s: sum(v["status"] == s for _, v in verdicts) for s in (COMPILED, REFUSED, CRASHED, TIMEOUT)},
                "refused_by": dict(Counter(v["keyword"] for _, v in verdicts if v["status"] == REFUSED).most_common()),
                "with_tests": sum(bool(row["tests"]) for row, _ in compiled),
                "over_constrained": sum(bool(v["over"]) for _, v in compiled),
                "under_constrained": sum(bool(v["under"]) for _, v in compiled),
                "valid_rejected": sum(len(v["over"]) for _, v in compiled),
                "invalid_accepted": sum(len(v["under"]) for _, v in compiled),
                "passing": sum(not v["over"] and not v["under"] for _, v in compiled),
                "compile_s": {
                    "total": round(sum(seconds), 3),
                    "median": round(statistics.median(seconds), 5) if seconds else None,
                    "p90": round(seconds[int(0.9 * (len(seconds) - 1))], 5) if seconds else None,
                    "max": round(seconds[-1], 5) if seconds else None,
                },
            }
            if engine == "pask":
                kinds = Counter(e["kind"] for _, v in compiled for e in v.get("under_explained", []))
                entry["invalid_accepted_by_kind"] = dict(kinds)
                entry["invalid_accepted_by_keyword"] = dict(
                    Counter(k for _, v in compiled for e in v.get("under_explained", []) for k in e["keywords"])
                )
            out[suite][engine] = entry
    return out


def _commit() -> str:
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return run.stdout.strip()


def _machine() -> dict:
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()}


def _write(result: dict, out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


def run_mask_mode(args: argparse.Namespace) -> dict:
    cases, sources = load_suites(args.suites)
    sample = sample_cases(cases, TOOL_SUBSETS, args.sample or 40)
    start = time.perf_counter()
    measured = run_masks(sample, args.tokenizer, args.engines, args.timeout)
    result = {
        "benchmark": "schemas-masks",
        "tokenizer": args.tokenizer,
        "engines": {e: f"{PACKAGES[e]} {version(PACKAGES[e])}" for e in args.engines},
        "sources": sources,
        "sample": {"subsets": list(TOOL_SUBSETS), "size": len(sample), "order": "sha256 of suite/id"},
        "method": {
            "instance": "the first valid instance, keys in declaration order, tokenized, then <|im_end|>",
            "pask": "compile_json_grammar + GrammarConstraint.mask / advance (one row)",
            "xgrammar": "compile_json_schema(any_whitespace=True, max_whitespace_cnt=1); fill_next_token_bitmask",
            "llguidance": "grammar_from_json_schema(whitespace_pattern '[ ]?'); numpy fill_next_token_bitmask",
            "agreement": "at each position all engines reached: equal allowed sets, Jaccard of the sets",
            "timeout_s": args.timeout,
        },
        "machine": _machine(),
        "commit": _commit(),
        "wall_s": round(time.perf_counter() - start, 1),
        **measured,
    }
    print(format_mask_table(result))
    _write(result, args.out)
    return result


def format_mask_table(result: dict) -> str:
    lines = [f"{'engine':<12}{'states':>8}{'mask us median':>16}{'p90':>10}{'compile s median':>18}"]
    for engine, t in result["mask_time"].items():
        c = result["compile_s"][engine]
        median = f"{c['median_us'] / 1e6:.3f}" if c["n"] else "-"
        lines.append(f"{engine:<12}{t['n']:>8}{t.get('median_us', 0):>16.1f}{t.get('p90_us', 0):>10.1f}{median:>18}")
    for pair, a in result["agreement"].items():
        lines.append(f"{pair}: {a['equal']}/{a['states']} states equal, mean Jaccard {a['jaccard_mean']}")
    return "\n".join(lines)


def _backend_engine(backend: str) -> str:
    """What a grammar backend runs, with package versions."""
    ours = f"pask (outlines-core {version('outlines-core')})"
    if backend.startswith("outlines"):
        return ours + (", unenforced constraints dropped" if backend == "outlines-loose" else "")
    try:
        guidance = f"llguidance {version('llguidance')}"
    except PackageNotFoundError:
        guidance = "llguidance (not installed)"
    return guidance if backend == "llguidance" else f"{ours} or {guidance}, per schema"


def run_generation_mode(args: argparse.Namespace) -> dict:
    cases, sources = load_suites(args.suites)
    sample = generation_cases(cases, args.sample or 24)
    start = time.perf_counter()
    backends = args.grammar_backends.split(",")
    runs = {backend: run_generation(sample, args.generate, args.max_tokens, backend) for backend in backends}
    result = {
        "benchmark": "schemas-generation",
        "engines": {b: _backend_engine(b) for b in backends},
        "model": args.generate,
        "max_tokens": args.max_tokens,
        "sources": sources,
        "sample": {"subsets": list(TOOL_SUBSETS), "size": len(sample), "order": "sha256 of suite/id"},
        "machine": _machine(),
        "commit": _commit(),
        "wall_s": round(time.perf_counter() - start, 1),
        "backends": runs,
    }
    print(json.dumps({b: r["summary"] for b, r in runs.items()}))
    _write(result, args.out)
    return result


def run(args: argparse.Namespace) -> dict:
    cases, sources = load_suites(args.suites)
    start = time.perf_counter()
    rows = judge_all(cases, args.engines, args.timeout)
    result = {
        "benchmark": "schemas",
        "engines": {e: f"{PACKAGES[e]} {version(PACKAGES[e])}" for e in args.engines},
        "sources": sources,
        "method": {
            "pask": "enforced_schema -> json_regex (whitespace [ ]?) -> outlines-core Index over the 256 single bytes",
            "xgrammar": "GrammarCompiler(max_threads=1, no cache).compile_json_schema(schema) (defaults)",
            "llguidance": "LLMatcher(grammar_from_json_schema(schema)) (defaults)",
            "vocabulary": "the 256 single bytes plus an end-of-text token, for every engine",
            "serialization": "json.dumps(data, ensure_ascii=False) as given, and with object keys in declaration "
            "order when that differs; accepted if either is accepted as a complete output",
            "timeout_s": args.timeout,
        },
        "machine": _machine(),
        "commit": _commit(),
        "wall_s": round(time.perf_counter() - start, 1),
        "summary": summarize(rows, args.engines),
        "cases": rows,
    }
    print(format_table(result["summary"], args.engines))
    _write(result, args.out)
    return result


def format_table(summary: dict, engines: tuple[str, ...]) -> str:
    head = f"{'suite':<14}{'engine':<12}{'schemas':>8}{'compiled':>9}{'refused':>8}{'crashed':>8}{'timeout':>8}"
    head += f"{'over':>6}{'under':>6}{'passing':>8}{'compile s':>10}"
    lines = [head]
    for suite, per_engine in summary.items():
        for engine in engines:
            e = per_engine[engine]
            lines.append(
                f"{suite:<14}{engine:<12}{e['schemas']:>8}{e['compiled']:>9}{e['refused']:>8}{e['crashed']:>8}"
                f"{e['timeout']:>8}{e['over_constrained']:>6}{e['under_constrained']:>6}{e['passing']:>8}"
                f"{e['compile_s']['total']:>10.2f}"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pask-jax bench schemas", description=__doc__.split("\n\n")[0])
    p.add_argument("--suites", type=Path, default=DEFAULT_SUITES, help="folder of pinned suite files")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per schema and engine")
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--tokenizer", help="mask mode: a checkpoint whose tokenizer the engines compile over")
    p.add_argument("--generate", metavar="MODEL", help="generation mode: greedy constrained outputs of this model")
    p.add_argument("--sample", type=int, help="mask / generation mode: how many schemas (default 40 / 24)")
    p.add_argument("--max-tokens", type=int, default=256, help="generation mode: tokens per answer")
    p.add_argument(
        "--grammar-backends",
        default="outlines",
        help="generation mode: comma-separated grammar backends (outlines, outlines-loose, llguidance, auto)",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.engines = tuple(args.engines.split(","))
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    if args.tokenizer and args.generate:
        parser.error("--tokenizer (mask mode) and --generate (generation mode) are separate runs: choose one")
    for backend in args.grammar_backends.split(","):
        try:
            grammar_backend(backend)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--grammar-backends: {exc}")
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample {args.sample}: must be at least 1")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: must be at least 1")
    if args.tokenizer and set(args.engines) != set(MASK_ENGINES):
        parser.error("mask mode compares all three engines: leave --engines at its default")
    if not args.suites.is_dir() or not suite_files(args.suites):
        parser.error(f"--suites {args.suites}: no suite files (scripts/build_schema_suites.py writes them)")
    for engine in args.engines:
        try:
            version(PACKAGES[engine])
        except PackageNotFoundError:
            parser.error(f"engine {engine}: {PACKAGES[engine]} is not installed (pip install 'pask-jax[bench]')")
    if args.tokenizer:
        return run_mask_mode(args)
    if args.generate:
        return run_generation_mode(args)
    return run(args)

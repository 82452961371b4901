"""Schema coverage on suites we did not write: our grammar next to xgrammar and llguidance, on the same schemas.

    pask-jax bench schemas [--suites tests/data/schema_suites] [--engines pask,xgrammar,llguidance]
                           [--timeout 120] [--out results/bench_schemas.json]

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

For ``pask`` each accepted invalid instance is explained by ``jsonschema`` (its failing keywords): **loosened**
when one of them is a keyword ``SCHEMA_KEYWORDS`` documents as loosened (``minimum``, ``uniqueItems``, ``oneOf``,
a format other than ``ENFORCED_FORMATS``, ...), **enforced** otherwise (a keyword the table says the grammar
enforces let a wrong value through: a defect), **unexplained** when jsonschema finds the instance valid. Each
engine runs in its own worker process (a timeout or a crash there does not end the run); `--timeout` is per schema.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import re
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import jsonschema
import referencing.exceptions

from pask_jax.structure.regex import json_regex
from pask_jax.structure.schema import ENFORCED_FORMATS, LOOSENED, SCHEMA_KEYWORDS, GrammarError, enforced_schema

ENGINES = ("pask", "xgrammar", "llguidance")
PACKAGES = {"pask": "outlines-core", "xgrammar": "xgrammar", "llguidance": "llguidance"}
DEFAULT_SUITES = Path("tests/data/schema_suites")
BYTE_EOS = 256  # the end-of-text token after the 256 single-byte tokens
END_OF_TURN = b"\x04"  # the marker byte our regexes end with (vocabulary.END_OF_TURN)
COMPILED, REFUSED, CRASHED, TIMEOUT = "compiled", "refused", "crashed", "timeout"


@dataclasses.dataclass
class Case:
    """One schema of a suite and its labelled instances (``{"data", "valid", "description"}``)."""

    suite: str
    id: str
    schema: Any
    tests: list[dict]


def load_suites(directory: Path) -> tuple[list[Case], list[dict]]:
    """The pinned suite files in ``directory`` -> (every case, each file's provenance: source, commit, selection)."""
    cases, sources = [], []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        sources.append({"file": path.name, **{k: data[k] for k in ("source", "commit", "path", "selection")}})
        for suite, items in data["suites"].items():
            cases.extend(Case(suite, item["id"], item["schema"], item["tests"]) for item in items)
    return cases, sources


# ---------------------------------------------------------------------------------------------------------------
# Instances -> the texts every engine is asked to accept


def _branches(schema: Any, root: Any, depth: int = 0) -> Iterator[dict]:
    """``schema`` and, through local ``$ref`` and the combinators, every schema whose ``properties`` apply."""
    if not isinstance(schema, dict) or depth > 8:
        return
    yield schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        yield from _branches(target, root, depth + 1)
    for keyword in ("allOf", "anyOf", "oneOf"):
        for branch in schema.get(keyword) or []:
            yield from _branches(branch, root, depth + 1)


def declaration_order(data: Any, schemas: list[Any], root: Any) -> Any:
    """``data`` with each object's keys in declaration order (declared keys first), as far as the schema says."""
    flat = [s for schema in schemas for s in _branches(schema, root)]
    if isinstance(data, dict):
        objects = [s for s in flat if isinstance(s.get("properties"), dict)]
        # a branch declaring every key first (anyOf branches differ in order), then the keys the others declare
        objects.sort(key=lambda s: not set(data) <= set(s["properties"]))
        declared = [name for s in objects for name in s["properties"]]
        order = [*dict.fromkeys(k for k in declared if k in data), *(k for k in data if k not in declared)]
        values = {key: [s["properties"][key] for s in flat if key in (s.get("properties") or {})] for key in order}
        return {key: declaration_order(data[key], values[key], root) for key in order}
    if isinstance(data, list):
        items = [s["items"] for s in flat if isinstance(s.get("items"), dict)]
        return [declaration_order(item, items, root) for item in data]
    return data


def serializations(data: Any, schema: Any) -> list[bytes]:
    """The texts an instance is tried as: as given, then in declaration order when that differs."""
    texts = [
        json.dumps(data, ensure_ascii=False),
        json.dumps(declaration_order(data, [schema], schema), ensure_ascii=False),
    ]
    return [text.encode() for text in dict.fromkeys(texts)]


# ---------------------------------------------------------------------------------------------------------------
# Engines: compile(schema) -> accepts(text) or raise Refused; run in a worker process


class Refused(Exception):
    """The engine declines the schema; ``keyword`` groups the refusals."""

    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword


_REFUSAL_RULES = (  # (pattern over our GrammarError message, label); the first match names the refusal
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
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            result = judge(compile_schema, *task)
        except Exception as exc:
            result = {"status": CRASHED, "message": f"{type(exc).__name__}: {exc}"[:300]}
        conn.send(result)


class Worker:
    """One engine in a spawned process, restarted after a timeout or a death."""

    def __init__(self, engine: str):
        self.engine, self.process, self.conn = engine, None, None

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(self.engine, child), daemon=True)
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{self.engine}: the worker did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.process = None

    def judge(self, schema: Any, texts: list[list[bytes]], timeout: float) -> dict:
        if self.process is None:
            self.start()
        try:
            self.conn.send((schema, texts))
            if self.conn.poll(timeout):
                return self.conn.recv()
            self.stop()
            return {"status": TIMEOUT, "message": f"no answer within {timeout:g} s"}
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self.process.exitcode if self.process else None
            self.stop()
            return {"status": CRASHED, "message": f"the worker process died (exit code {code})"}


# ---------------------------------------------------------------------------------------------------------------
# Explaining pask's under-constraints


def failing_keywords(schema: Any, data: Any) -> list[str]:
    """The keywords jsonschema says ``data`` fails (leaves of anyOf / oneOf errors; ``format:NAME`` for formats)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    found: list[str] = []

    def walk(errors) -> None:
        for error in errors:
            if error.context:
                walk(error.context)
            keyword = str(error.validator)
            found.append(f"format:{error.validator_value}" if keyword == "format" else keyword)

    try:
        walk(validator.iter_errors(data))
    except (jsonschema.exceptions.SchemaError, referencing.exceptions.Unresolvable):
        return ["(schema not checkable)"]
    return list(dict.fromkeys(found))


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
        worker = Worker(engine)
        try:
            for i, (case, row) in enumerate(zip(cases, rows, strict=True)):
                row["engines"][engine] = verdict(case, worker.judge(case.schema, texts[i], timeout), engine)
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
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "commit": _commit(),
        "wall_s": round(time.perf_counter() - start, 1),
        "summary": summarize(rows, args.engines),
        "cases": rows,
    }
    print(format_table(result["summary"], args.engines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
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
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.engines = tuple(args.engines.split(","))
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    if not args.suites.is_dir() or not any(args.suites.glob("*.json")):
        parser.error(f"--suites {args.suites}: no suite files (scripts/build_schema_suites.py writes them)")
    for engine in args.engines:
        try:
            version(PACKAGES[engine])
        except PackageNotFoundError:
            parser.error(f"engine {engine}: {PACKAGES[engine]} is not installed (pip install 'pask-jax[bench]')")
    return run(args)

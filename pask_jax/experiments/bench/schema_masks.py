"""Per-token mask time over a real tokenizer, and whether the three engines allow the same tokens.

    pask-jax bench schemas --tokenizer qwen2.5-coder-0.5b [--sample 40] [--out results/bench_schemas_masks.json]

For a fixed sample of MaskBench's tool-definition schemas (``TOOL_SUBSETS``, ordered by a hash of their ids, chosen
before any engine runs) each schema's first valid instance, written in declaration order (``serializations``), is
tokenized with the checkpoint's tokenizer and followed by the end-of-turn token. Each engine, in its own worker
process, compiles the schema over that tokenizer's whole vocabulary and walks the instance's tokens: before each
token it computes the token mask (timed), then feeds the token. The masks come back as packed bits (bit j of word w
allows token 32w+j, the layout of all three engines); at every position where all three engines are still walking
the allowed sets are compared (exact agreement; agreement with the tokens holding a newline, tab or carriage
return set aside, which only xgrammar's whitespace allows; Jaccard), and examples of each kind of difference kept.

- ``pask``: ``compile_json_grammar`` (regex, outlines-core Index, role tables) and ``GrammarConstraint.mask`` /
  ``advance``, as the engine's decode loop calls them for one row.
- ``xgrammar``: ``compile_json_schema(any_whitespace=True, max_whitespace_cnt=1)``, the closest to our ``[ ]?``
  (it also allows one newline or tab), ``GrammarMatcher.fill_next_token_bitmask`` / ``accept_token``.
- ``llguidance``: ``grammar_from_json_schema`` with ``whitespace_pattern`` ``[ ]?`` (our whitespace exactly),
  ``llguidance.numpy.fill_next_token_bitmask`` / ``consume_token``.

The vocabulary is the tokenizer's: ordinary tokens as their bytes, its special tokens never allowed except the end of
turn (``<|im_end|>``, the only stop token). Compile seconds include each engine's per-vocabulary precomputation.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pask_jax.experiments.bench.schema_suites import (
    COMPILED,
    REFUSED,
    Case,
    Refused,
    Worker,
    answer_tasks,
    serializations,
)

MASK_ENGINES = ("pask", "xgrammar", "llguidance")
TOOL_SUBSETS = ("Glaiveai2K", "BFCL", "MCPspec")
EXAMPLES_KEPT = 6  # per pair of engines, one per kind of difference


def sample_cases(cases: list[Case], subsets: tuple[str, ...], size: int) -> list[Case]:
    """``size`` cases of ``subsets`` with a valid instance, by a hash of suite and id (fixed, engine-blind)."""
    eligible = [c for c in cases if c.suite in subsets and any(t["valid"] for t in c.tests)]
    eligible.sort(key=lambda c: hashlib.sha256(f"{c.suite}/{c.id}".encode()).hexdigest())
    return eligible[:size]


def instance_text(case: Case) -> str:
    """The first valid instance, keys in declaration order (the order every engine here writes)."""
    data = next(t["data"] for t in case.tests if t["valid"])
    return serializations(data, case.schema)[-1].decode()


# ---------------------------------------------------------------------------------------------------------------
# Engines over a real vocabulary: compile(schema) -> (mask() -> u32[words], advance(token) -> accepted)

Walker = tuple[Callable[[], np.ndarray], Callable[[int], bool]]


def _vocabulary(tokenizer) -> tuple[list[bytes], int, list[int]]:
    """(each id's bytes, b"" for special tokens; the end-of-turn id; the special ids)."""
    special = tokenizer.special_tokens
    end = special.get("<|im_end|>", tokenizer.eos_token_ids[0])
    special_ids = sorted(set(special.values()))
    tokens = [b"" if i in special.values() else raw for i, raw in enumerate(tokenizer.all_token_bytes())]
    return tokens, end, special_ids


def _pask(tokenizer) -> Callable[[Any], Walker]:
    from pask_jax.structure.constraint import GrammarConstraint
    from pask_jax.structure.grammar import compile_json_grammar
    from pask_jax.structure.schema import GrammarError
    from pask_jax.structure.vocabulary import grammar_vocabulary

    size = grammar_vocabulary(tokenizer).size

    def compile_schema(schema: Any) -> Walker:
        try:
            constraint = GrammarConstraint([compile_json_grammar(schema, tokenizer)], size)
        except GrammarError as exc:
            raise Refused("GrammarError", str(exc)) from exc

        def advance(token: int) -> bool:
            try:
                constraint.advance(np.array([token], np.int32))
            except ValueError:  # the grammar refuses the token
                return False
            return True

        return (lambda: constraint.mask()[0].view(np.uint32)), advance

    return compile_schema


def _xgrammar(tokenizer) -> Callable[[Any], Walker]:
    import xgrammar as xgr

    tokens, end, _ = _vocabulary(tokenizer)
    info = xgr.TokenizerInfo(tokens, vocab_size=len(tokens), stop_token_ids=[end])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(schema: Any) -> Walker:
        try:
            grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=1)
        except Exception as exc:
            raise Refused(type(exc).__name__, str(exc)) from exc
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, len(tokens))

        def mask() -> np.ndarray:
            matcher.fill_next_token_bitmask(bitmask, 0)
            return bitmask[0].numpy().view(np.uint32).copy()

        return mask, matcher.accept_token

    return compile_schema


class _Tokenizer:
    """A tokenizer as llguidance's ``TokenizerWrapper`` wants one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens, self.eos_token_id, self.special_token_ids = _vocabulary(tokenizer)
        self.tokens = [raw or f"<special {i}>".encode() for i, raw in enumerate(self.tokens)]
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8", errors="replace"))


def _llguidance(tokenizer) -> Callable[[Any], Walker]:
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    wrapped = _Tokenizer(tokenizer)
    lltokenizer = LLTokenizer(TokenizerWrapper(wrapped))
    size = len(wrapped.tokens)

    def compile_schema(schema: Any) -> Walker:
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_pattern": "[ ]?"})
            matcher = LLMatcher(lltokenizer, grammar, log_level=0)
        except Exception as exc:
            raise Refused(type(exc).__name__, str(exc)) from exc
        if matcher.is_error():
            raise Refused("error", matcher.get_error())
        bitmask = allocate_token_bitmask(1, size)

        def mask() -> np.ndarray:
            fill_next_token_bitmask(matcher, bitmask, 0)
            return bitmask[0].view(np.uint32).copy()

        return mask, matcher.consume_token

    return compile_schema


_FACTORIES = {"pask": _pask, "xgrammar": _xgrammar, "llguidance": _llguidance}


def walk(compile_schema: Callable[[Any], Walker], schema: Any, token_ids: list[int]) -> dict:
    """Compile, then before each token its mask (timed) and the token fed; stops at the first refused token."""
    start = time.perf_counter()
    try:
        mask, advance = compile_schema(schema)
    except Refused as exc:
        return {"status": REFUSED, "message": str(exc)[:300]}
    compile_s = time.perf_counter() - start
    masks, seconds, refused_at = [], [], None
    for position, token in enumerate(token_ids):
        start = time.perf_counter()
        allowed = mask()
        seconds.append(time.perf_counter() - start)
        masks.append(allowed)
        if not advance(int(token)):
            refused_at = position
            break
    return {
        "status": COMPILED,
        "compile_s": compile_s,
        "mask_s": seconds,
        "refused_at": refused_at,
        "masks": np.stack(masks).tobytes() if masks else b"",
    }


def _serve(engine: str, tokenizer_name: str, conn) -> None:
    """Worker process: (schema, token ids) in, walk()'s dict out; any other exception is reported as a crash."""
    from pask_jax.checkpoint import Checkpoint

    compile_schema = _FACTORIES[engine](Checkpoint.open(tokenizer_name).tokenizer)
    answer_tasks(conn, lambda *task: walk(compile_schema, *task))


# ---------------------------------------------------------------------------------------------------------------
# Agreement


def _count(bits: np.ndarray) -> int:
    return int(np.unpackbits(bits.view(np.uint8)).sum())


def _ids(bits: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))


def compare(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    """(the allowed sets are equal, their Jaccard index) for two packed masks."""
    union = _count(a | b)
    return bool(np.array_equal(a, b)), (_count(a & b) / union if union else 1.0)


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "median_us": round(1e6 * statistics.median(ordered), 2),
        "p90_us": round(1e6 * ordered[int(0.9 * (len(ordered) - 1))], 2),
        "mean_us": round(1e6 * statistics.fmean(ordered), 2),
        "max_us": round(1e6 * ordered[-1], 2),
    }


def run_masks(cases: list[Case], tokenizer_name: str, engines: tuple[str, ...], timeout: float) -> dict:
    """Every sampled case through every engine's walk -> per case rows, mask-time and agreement summaries."""
    from pask_jax.checkpoint import Checkpoint

    tokenizer = Checkpoint.open(tokenizer_name).tokenizer
    _, end, _ = _vocabulary(tokenizer)
    words = -(-len(tokenizer.all_token_bytes()) // 32)
    # tokens holding a newline, tab or carriage return: xgrammar's whitespace allows them, ours and llguidance's not
    other_space = np.packbits(
        [bool(set(raw) & set(b"\t\n\r")) for raw in tokenizer.all_token_bytes()]
        + [False] * (32 * words - len(tokenizer.all_token_bytes())),
        bitorder="little",
    ).view(np.uint32)
    workers = {e: Worker(e, _serve, (tokenizer_name,)) for e in engines}
    pairs = [(a, b) for i, a in enumerate(engines) for b in engines[i + 1 :]]
    agreement: dict[str, dict] = {
        f"{a}/{b}": {"states": 0, "equal": 0, "equal_but_newlines": 0, "jaccard": []} for a, b in pairs
    }
    examples: list[dict] = []
    mask_seconds: dict[str, list[float]] = {e: [] for e in engines}
    rows = []
    try:
        for i, case in enumerate(cases):
            text = instance_text(case)
            token_ids = [*tokenizer.encode(text), end]
            row: dict = {"suite": case.suite, "id": case.id, "tokens": len(token_ids), "engines": {}}
            walked: dict[str, list[np.ndarray]] = {}
            for engine, worker in workers.items():
                result = worker.ask((case.schema, token_ids), timeout)
                if result["status"] == COMPILED:
                    masks = np.frombuffer(result.pop("masks"), np.uint32).reshape(-1, words)
                    walked[engine] = list(masks)
                    seconds = result.pop("mask_s")
                    mask_seconds[engine].extend(seconds)
                    result["compile_s"] = round(result["compile_s"], 4)
                    result["mask_us_median"] = round(1e6 * statistics.median(seconds), 2)
                    result["walked"] = len(seconds) if result["refused_at"] is None else result["refused_at"]
                row["engines"][engine] = result
            for a, b in pairs:
                if a not in walked or b not in walked:
                    continue
                shared = min(len(walked[a]), len(walked[b]))  # positions both engines reached
                stats = agreement[f"{a}/{b}"]
                for position in range(shared):
                    equal, jaccard = compare(walked[a][position], walked[b][position])
                    stats["states"] += 1
                    stats["equal"] += equal
                    stats["equal_but_newlines"] += bool(
                        np.array_equal(walked[a][position] & ~other_space, walked[b][position] & ~other_space)
                    )
                    stats["jaccard"].append(jaccard)
                    if not equal:
                        example = _example(case, tokenizer, token_ids, position, a, b, walked)
                        kept = [e for e in examples if e["engines"] == [a, b]]
                        kind = (example[f"only_{a}"][:2], example[f"only_{b}"][:2])  # one example per kind
                        if len(kept) < EXAMPLES_KEPT and all(
                            (e[f"only_{a}"][:2], e[f"only_{b}"][:2]) != kind for e in kept
                        ):
                            examples.append(example)
            rows.append(row)
            print(f"masks {i + 1}/{len(cases)} {case.suite}/{case.id}: {len(token_ids)} tokens", flush=True)
    finally:
        for worker in workers.values():
            worker.stop()
    return {
        "mask_time": {e: _quantiles(s) for e, s in mask_seconds.items()},
        "compile_s": {
            e: _quantiles([r["engines"][e]["compile_s"] for r in rows if r["engines"][e]["status"] == COMPILED])
            for e in engines
        },
        "agreement": {
            pair: {
                "states": s["states"],
                "equal": s["equal"],
                "equal_rate": round(s["equal"] / s["states"], 4) if s["states"] else None,
                "equal_but_newlines": s["equal_but_newlines"],
                "equal_but_newlines_rate": round(s["equal_but_newlines"] / s["states"], 4) if s["states"] else None,
                "jaccard_mean": round(statistics.fmean(s["jaccard"]), 4) if s["jaccard"] else None,
                "jaccard_min": round(min(s["jaccard"]), 4) if s["jaccard"] else None,
            }
            for pair, s in agreement.items()
        },
        "disagreement_examples": examples,
        "cases": rows,
    }


def _example(case: Case, tokenizer, token_ids: list[int], position: int, a: str, b: str, walked: dict) -> dict:
    """One state where two engines disagree: the text so far and a few tokens only one of them allows."""
    first, second = walked[a][position], walked[b][position]

    def spell(ids: np.ndarray) -> list[str]:
        return [tokenizer.decode([int(t)]) for t in ids[:6]]

    return {
        "suite": case.suite,
        "id": case.id,
        "position": position,
        "prefix": tokenizer.decode(token_ids[:position])[-80:],
        "engines": [a, b],
        "allowed": [_count(first), _count(second)],
        f"only_{a}": spell(_ids(first & ~second)),
        f"only_{b}": spell(_ids(second & ~first)),
    }

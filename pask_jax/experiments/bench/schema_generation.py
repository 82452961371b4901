"""Greedy generation under a grammar backend on suite schemas: do a small model's constrained outputs validate?

    pask-jax bench schemas --generate smollm2-135m [--sample 24] [--max-tokens 256]
                           [--grammar-backends outlines,llguidance] [--out results/bench_schemas_generation.json]

For a fixed sample of MaskBench's tool-definition schemas (``schema_masks.sample_cases``: the same hash order as the
mask bench; schemas whose JSON text is longer than ``MAX_SCHEMA_CHARS`` are left out, to keep prompts short), one
chat request per schema through ``LLM.chat``'s path (``LLM.prepare`` / ``LLM.generate``, method ``full``): the schema
in the user message (``PROMPT``), ``response_format`` ``json_schema`` with that schema, temperature 0. Each answer is
counted as **valid** (parses, and ``jsonschema`` with format checks finds it valid), **invalid** (parses, fails the
schema: a keyword the grammar loosens, or a defect), **unparsable** (not one JSON value: only possible when the token
limit cut it), or **refused** (the grammar refuses the schema: ``GrammarError`` when preparing); **hit the limit**
counts the answers with ``finish_reason`` ``length``. Each grammar backend (``LLM(grammar_backend=...)``) answers the
same requests in turn, one ``LLM`` each.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema

from pask_jax.experiments.bench.schema_masks import TOOL_SUBSETS, sample_cases
from pask_jax.experiments.bench.schema_suites import Case, failing_keywords

MAX_SCHEMA_CHARS = 3000
PROMPT = (
    "Reply with one JSON value that conforms to the JSON Schema below, with realistic values, and nothing else.\n\n"
    "{schema}"
)


def generation_cases(cases: list[Case], size: int) -> list[Case]:
    short = [c for c in cases if len(json.dumps(c.schema)) <= MAX_SCHEMA_CHARS]
    return sample_cases(short, TOOL_SUBSETS, size)


def request_body(case: Case, max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": PROMPT.format(schema=json.dumps(case.schema))}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": case.schema}},
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def judge_output(schema: Any, text: str | None) -> dict:
    """One answer's text -> its kind (valid / invalid / unparsable) and, when invalid, jsonschema's keywords."""
    try:
        data = json.loads(text or "")
    except json.JSONDecodeError:
        return {"kind": "unparsable"}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(data):
        return {"kind": "valid"}
    return {"kind": "invalid", "keywords": failing_keywords(schema, data)}


def run_generation(
    cases: list[Case], model: str, max_tokens: int, grammar_backend: str = "outlines", max_batch: int = 8
) -> dict:
    from pask_jax.llm import LLM
    from pask_jax.structure.schema import GrammarError

    llm = LLM(model, method="full", max_batch=max_batch, grammar_backend=grammar_backend)
    rows: list[dict] = [{"suite": c.suite, "id": c.id} for c in cases]
    prepared, where = [], []
    for i, case in enumerate(cases):
        try:
            prepared.append(llm.prepare(request_body(case, max_tokens)))
            where.append(i)
        except GrammarError as exc:
            rows[i] |= {"kind": "refused", "message": str(exc)[:300]}
    start = time.perf_counter()
    for indices, completions in llm.generate(prepared):
        for k, completion in zip(indices, completions, strict=True):
            row, case = rows[where[k]], cases[where[k]]
            if isinstance(completion, Exception):
                row |= {"kind": "error", "message": f"{type(completion).__name__}: {completion}"[:300]}
                continue
            choice = completion["choices"][0]
            text = choice["message"]["content"]
            row |= judge_output(case.schema, text)
            row |= {
                "finish_reason": choice["finish_reason"],
                "completion_tokens": completion["usage"]["completion_tokens"],
                "prompt_tokens": completion["usage"]["prompt_tokens"],
                "output": (text or "")[:400],
            }
    wall = time.perf_counter() - start
    kinds = ("valid", "invalid", "unparsable", "refused", "error")
    return {
        "grammar_backend": grammar_backend,
        "prompt": PROMPT,
        "generate_s": round(wall, 1),
        "summary": {
            "schemas": len(rows),
            **{k: sum(r.get("kind") == k for r in rows) for k in kinds},
            "hit_limit": sum(r.get("finish_reason") == "length" for r in rows),
            "completion_tokens": sum(r.get("completion_tokens", 0) for r in rows),
        },
        "cases": rows,
    }

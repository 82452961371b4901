"""Our grammar on schema suites we did not write: the pinned JSON-Schema-Test-Suite and MaskBench subsets in
tests/data/schema_suites (scripts/build_schema_suites.py), walked byte by byte through the outlines-core automaton
(no tokenizer, no model) as `pask-jax bench schemas` does.

A schema may be refused (with a message naming the keyword) but must not crash; a compiled schema accepts no
instance labelled invalid (a constraint the grammar does not enforce refuses the schema).
Valid instances the grammar rejects are the documented narrowings (closed objects, shallow free-form values, types
inferred from keywords, ...): counted by the bench, not failed here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pask_jax.experiments.bench.schema_generation import MAX_SCHEMA_CHARS, generation_cases, judge_output
from pask_jax.experiments.bench.schema_masks import _FACTORIES as mask_engines
from pask_jax.experiments.bench.schema_masks import TOOL_SUBSETS, _ids, compare, sample_cases, walk
from pask_jax.experiments.bench.schema_suites import (
    COMPILED,
    CRASHED,
    REFUSED,
    TIMEOUT,
    declaration_order,
    load_suites,
    serializations,
)
from pask_jax.experiments.bench.schemas import explain_under, judge_all, refusal_keyword

SUITES = Path(__file__).parents[1] / "data" / "schema_suites"
# Per schema: the pinned subset holds one schema whose automaton takes over a minute (Github_easy---o9842: a
# 255-character pattern and maxLength inside maxItems 100); it times out and is reported, not failed.
TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def verdicts() -> list[dict]:
    cases, _ = load_suites(SUITES)
    return [row["engines"]["pask"] | {"id": row["id"]} for row in judge_all(cases, ("pask",), TIMEOUT_S, False)]


def test_suites_are_pinned_with_their_source():
    cases, sources = load_suites(SUITES)
    assert {s["source"] for s in sources} == {
        "github:json-schema-org/JSON-Schema-Test-Suite",
        "github:guidance-ai/jsonschemabench",
    }
    assert all(re.fullmatch(r"[0-9a-f]{40}", s["commit"]) for s in sources)
    assert {c.suite for c in cases} >= {"draft2020-12", "Glaiveai2K", "BFCL", "MCPspec"}
    for source in sources:
        assert (SUITES / json.loads((SUITES / source["file"]).read_text())["license"]).is_file()


def test_compressed_suites_load_as_the_plain_ones(tmp_path: Path):
    """The large selection (results/schema_suites_large) is pinned gzip-compressed: the same cases and provenance."""
    import gzip

    for path in sorted(SUITES.glob("*.json")):
        (tmp_path / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes()))
    plain, compressed = load_suites(SUITES), load_suites(tmp_path)
    assert [c.id for c in compressed[0]] == [c.id for c in plain[0]] and len(plain[0]) > 300
    assert [c.tests for c in compressed[0]] == [c.tests for c in plain[0]]
    assert [s["file"] for s in compressed[1]] == [f"{s['file']}.gz" for s in plain[1]]
    # the committed large selection: over 1,000 MaskBench schemas and every draft2020-12 group
    large, _ = load_suites(Path(__file__).parents[2] / "results" / "schema_suites_large")
    assert sum(c.suite != "draft2020-12" for c in large) >= 1000 and sum(c.suite == "draft2020-12" for c in large) > 300


def test_no_schema_crashes(verdicts):
    assert [(v["id"], v["message"]) for v in verdicts if v["status"] == CRASHED] == []
    assert {v["status"] for v in verdicts} <= {COMPILED, REFUSED, TIMEOUT}
    assert sum(v["status"] == COMPILED for v in verdicts) > len(verdicts) / 2


def test_refusals_name_what_is_refused(verdicts):
    refused = [v for v in verdicts if v["status"] == REFUSED]
    assert refused
    assert [(v["id"], v["message"]) for v in refused if v["keyword"] == "other"] == []


def test_no_invalid_instance_gets_through(verdicts):
    """Nothing is loosened by default: a schema with a constraint our translation does not enforce is refused, and
    no compiled schema accepts an instance the suites label invalid (date-times without a zone included)."""
    assert [(v["id"], v["under_explained"]) for v in verdicts if v.get("under")] == []
    refused = {v["keyword"] for v in verdicts if v["status"] == REFUSED}
    assert {"multipleOf (not enforced)", "uniqueItems (not enforced)", "format:uri (not enforced)"} <= refused


def test_explanations_follow_the_keyword_table():
    """An accepted invalid instance is explained by its failing keywords' status in SCHEMA_KEYWORDS."""
    assert explain_under({"type": "integer", "minimum": 1}, 0) == {"kind": "enforced", "keywords": ["minimum"]}
    assert explain_under({"type": "integer", "multipleOf": 2}, 3) == {"kind": "loosened", "keywords": ["multipleOf"]}
    assert explain_under({"type": "string", "maxLength": 1}, "ab") == {"kind": "enforced", "keywords": ["maxLength"]}
    assert explain_under({"type": "string", "format": "email"}, "x")["kind"] == "loosened"


def test_instances_are_also_tried_in_declaration_order():
    schema = {
        "type": "object",
        "properties": {"b": {"type": "integer"}, "a": {"$ref": "#/$defs/pair"}},
        "$defs": {"pair": {"anyOf": [{"properties": {"y": {}, "x": {}}}, {"properties": {"x": {}, "z": {}}}]}},
    }
    data = {"extra": 0, "a": {"z": 1, "x": 2}, "b": 3}
    assert list(declaration_order(data, [schema], schema)) == ["b", "a", "extra"]
    assert list(declaration_order(data, [schema], schema)["a"]) == ["x", "z"]  # the branch declaring both keys
    assert serializations(data, schema) == [
        b'{"extra": 0, "a": {"z": 1, "x": 2}, "b": 3}',
        b'{"b": 3, "a": {"x": 2, "z": 1}, "extra": 0}',
    ]
    assert serializations({"b": 1}, schema) == [b'{"b": 1}']


@pytest.mark.parametrize(
    ("message", "keyword"),
    [
        ("response_format, schema at '#': keyword 'not' is refused: negation has no ...", "not"),
        ("response_format, schema at '#/x': unknown keyword 'example'; the supported ones ...", "example (unknown)"),
        ("response_format, schema at '#': keyword 'oneOf' with sibling keywords ['type']", "oneOf with siblings"),
        ("response_format, schema at '#': required ['a'] are not among its properties", "required not in properties"),
        ("response_format, schema at '#': $ref 'http://x/y.json': only local references ...", "$ref not local"),
        ("response_format, schema at '#': keyword 'uniqueItems' is not enforced by ...", "uniqueItems (not enforced)"),
        ("response_format, schema at '#/a': 'format' 'email' is not enforced by ...", "format:email (not enforced)"),
    ],
)  # fmt: skip
def test_refusal_keyword(message, keyword):
    assert refusal_keyword(message) == keyword


# ---- mask time, agreement and generation: the parts that need no peer engine and no model --------------------------


def test_the_samples_are_fixed_tool_definition_schemas():
    cases, _ = load_suites(SUITES)
    sample = sample_cases(cases, TOOL_SUBSETS, 40)
    assert len(sample) == 40 and {c.suite for c in sample} <= set(TOOL_SUBSETS)
    assert all(any(t["valid"] for t in c.tests) for c in sample)
    assert [c.id for c in sample] == [c.id for c in sample_cases(list(reversed(cases)), TOOL_SUBSETS, 40)]
    short = generation_cases(cases, 24)
    assert len(short) == 24 and all(len(json.dumps(c.schema)) <= MAX_SCHEMA_CHARS for c in short)


def test_mask_comparison_counts_tokens():
    a = np.zeros(4, np.uint32)
    b = np.zeros(4, np.uint32)
    a[0], b[0] = 0b1011, 0b0011  # tokens {0, 1, 3} and {0, 1}
    b[3] = 1 << 31  # token 127
    assert compare(a, a) == (True, 1.0)
    assert compare(a, b) == (False, 2 / 4)
    assert list(_ids(a)) == [0, 1, 3] and list(_ids(b)) == [0, 1, 127]


def test_the_pask_walk_over_qwen_masks_each_next_token(qwen_tok):
    """Our grammar over the real vocabulary: every token of a valid instance is in the mask before it, and an
    out-of-range integer's digit is not."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 5}}, "required": ["n"]}
    end = qwen_tok.special_tokens["<|im_end|>"]
    ids = [*qwen_tok.encode('{"n": 4}'), end]
    result = walk(mask_engines["pask"](qwen_tok), schema, ids)
    masks = np.frombuffer(result["masks"], np.uint32).reshape(len(ids), -1)
    assert result["status"] == COMPILED and result["refused_at"] is None and len(result["mask_s"]) == len(ids)
    for position, token in enumerate(ids):
        assert token in set(_ids(masks[position])), (position, qwen_tok.decode([token]))
    (six,) = qwen_tok.encode("6")
    assert six not in set(_ids(masks[ids.index(qwen_tok.encode("4")[0])]))
    refused = walk(mask_engines["pask"](qwen_tok), schema, [*qwen_tok.encode('{"n": 6}'), end])
    assert refused["refused_at"] == ids.index(qwen_tok.encode("4")[0])


def test_generated_answers_are_judged_by_jsonschema():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}, "required": ["n"]}
    assert judge_output(schema, '{"n": 4}') == {"kind": "valid"}
    assert judge_output(schema, '{"n": 3}') == {"kind": "invalid", "keywords": ["multipleOf"]}
    assert judge_output(schema, '{"n": ') == {"kind": "unparsable"}
    assert judge_output(schema, None) == {"kind": "unparsable"}

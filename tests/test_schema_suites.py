"""Our grammar on schema suites we did not write: the pinned JSON-Schema-Test-Suite and MaskBench subsets in
tests/data/schema_suites (scripts/build_schema_suites.py), walked byte by byte through the outlines-core automaton
(no tokenizer, no model) as `pask-jax bench schemas` does.

A schema may be refused (with a message naming the keyword) but must not crash; an invalid instance the grammar
accepts must fail a keyword SCHEMA_KEYWORDS documents as loosened, never only keywords it says are enforced.
Valid instances the grammar rejects are the documented narrowings (closed objects, shallow free-form values, types
inferred from keywords, ...): counted by the bench, not failed here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pask_jax.experiments.bench.schemas import (
    COMPILED,
    CRASHED,
    REFUSED,
    TIMEOUT,
    declaration_order,
    explain_under,
    judge_all,
    load_suites,
    refusal_keyword,
    serializations,
)

SUITES = Path(__file__).parent / "data" / "schema_suites"
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


def test_no_schema_crashes(verdicts):
    assert [(v["id"], v["message"]) for v in verdicts if v["status"] == CRASHED] == []
    assert {v["status"] for v in verdicts} <= {COMPILED, REFUSED, TIMEOUT}
    assert sum(v["status"] == COMPILED for v in verdicts) > len(verdicts) / 2


def test_refusals_name_what_is_refused(verdicts):
    refused = [v for v in verdicts if v["status"] == REFUSED]
    assert refused
    assert [(v["id"], v["message"]) for v in refused if v["keyword"] == "other"] == []


def test_no_enforced_keyword_lets_an_invalid_instance_through(verdicts):
    """Every accepted invalid instance fails a loosened keyword (or one jsonschema cannot check here)."""
    explained = [(v["id"], e) for v in verdicts for e in v.get("under_explained", [])]
    assert [(i, e) for i, e in explained if e["kind"] == "enforced"] == []
    # the bench does see the loosened numeric bounds: their invalid instances get through
    assert {"minimum", "maximum"} <= {k for _, e in explained if e["kind"] == "loosened" for k in e["keywords"]}


def test_bounds_are_documented_as_loosened():
    """An accepted out-of-bounds integer is explained by 'minimum', which SCHEMA_KEYWORDS marks loosened."""
    assert explain_under({"type": "integer", "minimum": 1}, 0) == {"kind": "loosened", "keywords": ["minimum"]}
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
    ],
)  # fmt: skip
def test_refusal_keyword(message, keyword):
    assert refusal_keyword(message) == keyword

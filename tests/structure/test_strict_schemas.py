"""No schema loosened silently: a constraint our translation does not enforce (LOOSENED in ``SCHEMA_KEYWORDS``) is
refused naming the keyword, its place and the backends that enforce it; ``grammar_backend="outlines-loose"`` opts in
to dropping it; ``"auto"`` gives it to llguidance. Also: which ``oneOf`` is exact, and the formats' patterns.

Grammars are built over the 256 single bytes (no tokenizer) except where a backend compiles one (the offline Qwen
tokenizer; llguidance's compiles take milliseconds, ours one small tool)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from outlines_core import Index, Vocabulary

from pask_jax.arguments import grammar_backend
from pask_jax.requests import RequestBuilder, RequestError
from pask_jax.structure import GrammarError, compile_json_grammar, parse_tools
from pask_jax.structure import backend as B
from pask_jax.structure.constraint import GrammarConstraint, SplitConstraint
from pask_jax.structure.grammar import CompiledGrammar
from pask_jax.structure.guidance import GuidanceConstraint, GuidanceGrammar
from pask_jax.structure.regex import json_regex
from pask_jax.structure.schema import LOOSENED, SCHEMA_KEYWORDS, Unenforceable
from pask_jax.structure.schema_rewrite import enforced_schema

VOCAB = 151936  # the Qwen2.5 models' embedding rows
# One tiny schema per LOOSENED constraint: (what the error names, the schema, a value it refuses that dropping the
# constraint lets through, whether llguidance enforces it). Formats: one llguidance knows, one it does not.
LOOSENED_CASES = {
    "multipleOf": ("keyword 'multipleOf'", {"type": "integer", "multipleOf": 2}, 3, True),
    "uniqueItems": (
        "keyword 'uniqueItems'",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 1],
        False,
    ),
    "oneOf": ("keyword 'oneOf'", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1, False),
    "format": ("'format' 'email'", {"type": "string", "format": "email"}, "not an email", True),
    "format (unknown to llguidance)": (
        "'format' 'uri-template'",
        {"type": "string", "format": "uri-template"},
        "http://example.com/{",
        False,
    ),
}
_BYTES = Vocabulary(256, {bytes([i]): [i] for i in range(256)})


def byte_accepts(schema: dict, value, *, loosen: bool = False) -> bool:
    """Whether the ``response_format`` grammar of ``schema`` (over the single bytes) accepts ``value``'s JSON."""
    index = Index(json_regex(enforced_schema(schema, "response_format", loosen=loosen)), _BYTES)
    state = index.get_initial_state()
    for byte in json.dumps(value).encode() + b"\x04":
        state = index.get_next_state(state, byte)
        if state is None:
            return False
    return state in set(index.get_final_states())


def test_every_loosened_keyword_has_a_case():
    loosened = {k for k, (status, _) in SCHEMA_KEYWORDS.items() if status == LOOSENED}
    assert loosened | {"format"} == {case.split()[0] for case in LOOSENED_CASES}  # format: for most values


@pytest.mark.parametrize("case", sorted(LOOSENED_CASES))
def test_a_loosened_constraint_is_refused_naming_it_its_place_and_who_enforces_it(case):
    named, schema, _, by_guidance = LOOSENED_CASES[case]
    nested = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(Unenforceable) as refused:
        enforced_schema(nested, "function 'f'")
    message = str(refused.value)
    assert message.startswith(f"function 'f', schema at '#/properties/x': {named} is not enforced")
    assert ("'llguidance' (or 'auto') enforces it" in message) == by_guidance
    assert "'outlines-loose' drops it" in message
    with pytest.raises(GrammarError, match=rf"{named} is not enforced"):  # a tool list, when it is parsed
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": nested}}])


@pytest.mark.parametrize("case", sorted(LOOSENED_CASES))
def test_the_opt_in_compiles_and_drops_the_constraint(case):
    _, schema, refused_value, _ = LOOSENED_CASES[case]
    assert byte_accepts(schema, refused_value, loosen=True)  # what the opt-in means: the value gets through


@pytest.mark.parametrize("case", sorted(LOOSENED_CASES))
def test_auto_gives_a_loosened_constraint_to_llguidance(case, qwen_tok):
    """llguidance enforces it (and refuses the value), or refuses the schema, as our error message says."""
    _, schema, refused_value, by_guidance = LOOSENED_CASES[case]
    auto = B.backend_for("auto")
    if not by_guidance:
        with pytest.raises(GrammarError, match="llguidance cannot compile the schema"):
            auto.compile_json(schema, qwen_tok)
        return
    grammar = auto.compile_json(schema, qwen_tok)
    assert isinstance(grammar, GuidanceGrammar) and grammar.kind == "json"
    assert not _follows(auto.constraint([grammar], VOCAB), qwen_tok.encode(json.dumps(refused_value) + "<|im_end|>"))


def _follows(constraint, ids: list[int]) -> bool:
    """Whether each token of ``ids`` is allowed by the constraint's mask in turn (row 0)."""
    for token in ids:
        bits = constraint.mask()[0].view(np.uint32)
        if not (bits[token >> 5] >> (token & 31)) & 1:
            return False
        constraint.advance(np.array([token]))
    return True


def test_the_backends_as_a_request_builder_parses_tools(qwen_tok):
    nested = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with pytest.raises(RequestError, match=r"tools: function 'f', schema at '#/properties/n': keyword 'multipleOf'"):
        RequestBuilder(qwen_tok, None, grammar_backend="outlines").parse(body)  # refused when parsed, before a compile
    assert RequestBuilder(qwen_tok, None, grammar_backend="outlines-loose").parse(body).tools
    assert RequestBuilder(qwen_tok, None).parse(body).tools  # the default, llguidance, enforces it
    assert RequestBuilder(qwen_tok, None, grammar_backend="auto").parse(body).tools


def test_a_response_schema_is_refused_before_the_compile(qwen_tok, monkeypatch):
    def no_index(*args, **kwargs):
        raise AssertionError("the index was built")

    monkeypatch.setattr("pask_jax.structure.grammar.Index", no_index)
    with pytest.raises(Unenforceable, match=r"^response_format, schema at '#/items': keyword 'multipleOf'"):
        compile_json_grammar({"type": "array", "items": {"type": "number", "multipleOf": 0.5}}, qwen_tok)


def test_auto_without_llguidance_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(B.importlib.util, "find_spec", lambda name: None if name == "llguidance" else real(name))
    auto = B.backend_for("auto")
    assert auto.choose(lambda: enforced_schema({"type": "integer"}, "response_format")) is B.backend_for("outlines")
    parameters = {"type": "object", "properties": {"n": LOOSENED_CASES["multipleOf"][1]}}
    with pytest.raises(GrammarError, match=r"keyword 'multipleOf'.*'auto' gives it to llguidance.*pip install"):
        auto.check_tools([{"name": "f", "parameters": parameters}])


def test_auto_decodes_a_batch_of_both_backends_as_each_alone(qwen_tok):
    auto = B.backend_for("auto")
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    ours = auto.compile_calls([weather], qwen_tok, parallel=False)
    theirs = auto.compile_json(LOOSENED_CASES["multipleOf"][1], qwen_tok)
    assert isinstance(ours, CompiledGrammar) and isinstance(theirs, GuidanceGrammar)
    assert type(auto.constraint([ours], VOCAB)) is GrammarConstraint
    assert type(auto.constraint([theirs], VOCAB)) is GuidanceConstraint
    split = auto.constraint([theirs, ours], VOCAB)
    assert isinstance(split, SplitConstraint)
    alone = [
        B.backend_for("llguidance").constraint([theirs], VOCAB),
        B.backend_for("outlines").constraint([ours], VOCAB),
    ]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    rows = [qwen_tok.encode("42<|im_end|>"), qwen_tok.encode(f"{call}<|im_end|>")]
    end = rows[0][-1]  # a finished row takes its end-of-turn token again
    for step in range(max(map(len, rows))):
        tokens = np.array([row[step] if step < len(row) else end for row in rows])
        mask = split.mask()
        for i, constraint in enumerate(alone):
            np.testing.assert_array_equal(mask[i], constraint.mask()[0])
        roles = split.advance(tokens)
        assert roles.tolist() == [int(c.advance(tokens[i : i + 1])[0]) for i, c in enumerate(alone)]
        np.testing.assert_array_equal(split.called_tools(), [int(c.called_tools()[0]) for c in alone])
    assert split.steps == len(rows[1]) and split.mask_s > 0


# ---- which oneOf is exact ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "one_of",
    [
        [{"type": "integer"}, {"type": "null"}],
        [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
        [{"enum": ["a", "b"]}, {"const": "c"}],
        [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],  # a tagged union
    ],
)
def test_a_one_of_no_value_can_match_twice_is_exact(one_of):
    animal = {"type": "object", "required": ["kind"], "properties": {"kind": {}, "name": {"type": "string"}}}
    defs = {
        "cat": animal | {"properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}},
        "dog": animal | {"properties": {"kind": {"const": "dog"}, "name": {"type": "string"}}},
    }
    enforced = enforced_schema({"oneOf": one_of, "$defs": defs}, "response_format")
    assert len(enforced["anyOf"]) == len(one_of)


@pytest.mark.parametrize(
    "one_of",
    [
        [{"type": "integer"}, {"type": "number"}],  # 1 is both
        [{"minLength": 2}, {"type": "integer"}],  # minLength allows any integer: 5 matches both
        [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "object"}],
        [{"enum": [1, 2]}, {"enum": [2.0, 3]}],  # 2 == 2.0 in JSON
        [{"type": "object", "properties": {"k": {"const": 1}}}, {"type": "object", "properties": {"k": {"const": 2}}}],
    ],
)
def test_a_one_of_whose_branches_may_overlap_is_loosened(one_of):
    with pytest.raises(Unenforceable, match=r"keyword 'oneOf' is not enforced .*its branches can overlap"):
        enforced_schema({"oneOf": one_of}, "response_format")
    assert enforced_schema({"oneOf": one_of}, "response_format", loosen=True)


# ---- formats ---------------------------------------------------------------------------------------------------


def test_date_time_needs_its_zone_and_a_real_day():
    """Regression: outlines-core's date-time pattern made the zone optional (MaskBench's Glaive
    create_calendar_event schemas: "2024-12-31T18:00:00" is not an RFC 3339 date-time)."""
    schema = {"type": "string", "format": "date-time"}
    for good in ("2025-01-01T01:00:00Z", "2024-02-29T23:59:59.123+05:30", "2000-02-29T00:00:00-00:00"):
        assert byte_accepts(schema, good), good
    for bad in ("2024-12-31T18:00:00", "-2024-01-01T00:00:00Z", "12024-01-01T00:00:00Z", "2023-02-29T00:00:00Z"):
        assert not byte_accepts(schema, bad), bad


def test_date_has_the_days_each_month_has():
    schema = {"type": "string", "format": "date"}
    for good in ("2024-02-29", "2000-02-29", "2023-04-30", "2023-12-31"):
        assert byte_accepts(schema, good), good
    for bad in ("2023-02-29", "1900-02-29", "2023-04-31", "2023-13-01", "2023-00-10"):
        assert not byte_accepts(schema, bad), bad


def test_the_command_line_takes_the_new_backends():
    assert grammar_backend("outlines-loose") == "outlines-loose"
    assert grammar_backend("auto") == "auto"  # llguidance or not: it is needed only for the schemas ours refuses


@pytest.mark.parametrize(
    ("schema", "accepted", "refused"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, [1, 1], ["a"]),
        ({"type": "integer", "multipleOf": 1}, 3, 1.5),
        ({"type": "integer", "format": "int32"}, 7, "7"),  # OpenAPI's format on a non-string: nothing to enforce
    ],
)
def test_a_loosened_keyword_that_constrains_nothing_here_is_exact(schema, accepted, refused):
    assert byte_accepts(schema, accepted) and not byte_accepts(schema, refused)

"""The llguidance grammar backend beside ours: the same roles and called tools on the same outputs, the schema
enforced by its masks, its own JSON Schema coverage, and `LLM` end to end (arguments checked with `jsonschema`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from pask_jax.arguments import GRAMMAR_BACKENDS
from pask_jax.llm import LLM
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.requests import RequestError
from pask_jax.structure import GrammarConstraint, GrammarError, compile_grammar, compile_json_grammar
from pask_jax.structure.backend import BACKENDS, backend_for
from pask_jax.structure.guidance import (
    GuidanceConstraint,
    compile_guidance_grammar,
    compile_guidance_json_grammar,
    declared_keys_only,
)
from pask_jax.structure.roles import NO_TOOL

VOCAB = 151936  # the Qwen2.5 models' embedding rows (past the tokenizer's ids: padding)
WEATHER = {
    "name": "get_weather",
    "description": "",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "description": "",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
}
CALL = '{"name": "add", "arguments": {"a": 1, "b": 2.5}}'
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
OUTPUTS = [  # (tool_choice, a turn both backends must accept)
    ("required", f"{WEATHER_CALL}<|im_end|>"),
    ("required", f"{WEATHER_CALL}\n<tool_call>\n{CALL}\n</tool_call>\n<|im_end|>"),
    ("auto", "It is sunny in Paris today.<|im_end|>"),
    ("auto", f"{CALL}<|im_end|>"),
    ("auto", f"```json\n{CALL}\n```<|im_end|>"),
    ("auto", f"<tool_call>\n{CALL}\n</tool_call><|im_end|>"),
]
# what ours refuses (SCHEMA_KEYWORDS: minProperties, prefixItems) and llguidance enforces
BOOKING = {
    "name": "book",
    "description": "",
    "parameters": {
        "type": "object",
        "properties": {
            "seat": {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["A", "B"]}], "items": False},
            "meal": {"type": "string"},
        },
        "minProperties": 1,
        "additionalProperties": False,
    },
}


OBJECT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def _allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool(mask_row.view(np.uint32)[token >> 5] >> (token & 31) & 1)


def _walk(constraint, ids: list[int]) -> tuple[list[int], list[int]]:
    """Feed a turn's tokens, each checked against the mask -> (roles, called tool after each token)."""
    roles, called = [], []
    for token in ids:
        assert _allowed(constraint.mask()[0], token), token
        roles.append(int(constraint.advance(np.array([token]))[0]))
        called.append(int(constraint.called_tools()[0]))
    return roles, called


def _accepts(grammar, ids: list[int]) -> bool:
    """Whether the llguidance constraint allows every token of a turn."""
    constraint = GuidanceConstraint([grammar], VOCAB)
    for token in ids:
        if not _allowed(constraint.mask()[0], token):
            return False
        constraint.advance(np.array([token]))
    return True


@pytest.mark.parametrize(("tool_choice", "text"), OUTPUTS)
def test_the_same_roles_and_called_tools_as_our_grammar(qwen_tok, tool_choice: str, text: str):
    ids = qwen_tok.encode(text)
    ours = _walk(GrammarConstraint([compile_grammar([WEATHER, ADD], qwen_tok, tool_choice=tool_choice)], VOCAB), ids)
    guided = compile_guidance_grammar([WEATHER, ADD], qwen_tok, tool_choice=tool_choice)
    assert _walk(GuidanceConstraint([guided], VOCAB), ids) == ours
    expected = {i for i, f in enumerate((WEATHER, ADD)) if f'"name": "{f["name"]}"' in text}
    assert set(ours[1]) - {NO_TOOL} == expected  # the release sees every call's tool, from both backends


@pytest.fixture(scope="module")
def plain_tok(qwen_tok):
    """The Qwen tokenizer as a model without <tool_call> special tokens has it: the call markers are text."""
    plain = copy.copy(qwen_tok)
    plain.special_tokens = {
        k: v for k, v in qwen_tok.special_tokens.items() if k not in ("<tool_call>", "</tool_call>")
    }
    plain._all_bytes = None
    return plain


PLAIN = f"{WEATHER_CALL}\n<tool_call>\n{CALL}\n</tool_call><|im_end|>"  # the markers spelled as text
FENCED = f"```json\n{json.dumps(json.loads(CALL), indent=2)}\n{CALL}\n```<|im_end|>"  # pretty-printed, then a line


@pytest.mark.parametrize("framing", ["json_fence", "text markers"])
def test_the_other_framings_get_the_same_roles_as_our_grammar(qwen_tok, plain_tok, framing: str):
    tok, framing, text = (qwen_tok, framing, FENCED) if framing == "json_fence" else (plain_tok, "tool_call", PLAIN)
    ids = tok.encode(text)
    ours = _walk(GrammarConstraint([compile_grammar([WEATHER, ADD], tok, framing=framing)], VOCAB), ids)
    guided = compile_guidance_grammar([WEATHER, ADD], tok, framing=framing)
    assert _walk(GuidanceConstraint([guided], VOCAB), ids) == ours
    assert not _accepts(guided, tok.encode(text.replace('"b": 2.5', '"b": "x"')))  # the schema still holds
    single = compile_guidance_grammar([WEATHER, ADD], tok, framing=framing, parallel=False)
    assert not _accepts(single, ids)  # two calls
    with pytest.raises(GrammarError, match="tool_choice 'auto' needs"):
        compile_guidance_grammar([ADD], tok, framing=framing, tool_choice="auto")


def test_a_response_schema_gets_the_same_roles(qwen_tok):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "tags": {"type": "array"}}, "required": ["x"]}
    ids = qwen_tok.encode('{"x": 5, "tags": ["a", 2]}<|im_end|>')
    ours = _walk(GrammarConstraint([compile_json_grammar(schema, qwen_tok)], VOCAB), ids)
    assert _walk(GuidanceConstraint([compile_guidance_json_grammar(schema, qwen_tok)], VOCAB), ids) == ours


def test_the_masks_enforce_the_schema_and_the_end_of_turn(qwen_tok):
    grammar = compile_guidance_grammar([WEATHER], qwen_tok, parallel=False)
    good = qwen_tok.encode(f"{WEATHER_CALL}<|im_end|>")
    assert _accepts(grammar, good)
    for bad in ('"days": 9}', '"days": 0}', '"week": 3}'):  # out of range; out of range; not a property
        text = WEATHER_CALL.replace('"days": 3}', bad)
        assert not _accepts(grammar, qwen_tok.encode(text)), bad
    assert not _accepts(grammar, qwen_tok.encode(f"{WEATHER_CALL}\n{WEATHER_CALL}"))  # one call only
    constraint = GuidanceConstraint([grammar], VOCAB)
    _walk(constraint, good)
    assert constraint.finished[0] and np.flatnonzero(constraint.mask()[0]).size >= 1  # finished: EOS ids only
    assert not _allowed(constraint.mask()[0], good[1])


def test_llguidance_enforces_keywords_ours_refuses(qwen_tok):
    with pytest.raises(GrammarError, match="prefixItems|minProperties"):
        compile_grammar([BOOKING], qwen_tok)
    grammar = compile_guidance_grammar([BOOKING], qwen_tok)

    def turn(arguments: str) -> list[int]:
        return qwen_tok.encode(f'<tool_call>\n{{"name": "book", "arguments": {arguments}}}\n</tool_call><|im_end|>')

    assert _accepts(grammar, turn('{"seat": [12, "A"]}')) and _accepts(grammar, turn('{"meal": "veg"}'))
    assert not _accepts(grammar, turn("{}"))  # minProperties
    assert not _accepts(grammar, turn('{"seat": ["A", 12]}'))  # prefixItems
    assert not _accepts(grammar, turn('{"seat": [12, "A", 3]}'))  # no items past the prefix


def test_a_schema_llguidance_cannot_compile_names_the_tool(qwen_tok):
    broken = {"name": "broken", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}
    with pytest.raises(GrammarError, match=r"tools\[1\] \('broken'\): llguidance cannot compile") as refused:
        compile_guidance_grammar([WEATHER, broken], qwen_tok)
    assert "\n" not in str(refused.value)  # one line


def test_one_interface_chosen_by_name_decodes_only_its_own_grammars(qwen_tok):
    assert tuple(BACKENDS) == GRAMMAR_BACKENDS  # the command line's names (JAX-free) are the backends'
    with pytest.raises(ValueError, match="unknown grammar_backend 'xgrammar'"):
        backend_for("xgrammar")
    grammars = {}
    for name, constraint_type in (("outlines", GrammarConstraint), ("llguidance", GuidanceConstraint)):
        backend = backend_for(name)
        grammars[name] = backend.compile_calls([WEATHER, ADD], qwen_tok, tool_choice="auto")
        assert grammars[name].kind == "auto" and grammars[name].function_names == ("get_weather", "add")
        assert type(backend.constraint([grammars[name]], VOCAB)) is constraint_type
    ids = qwen_tok.encode(OUTPUTS[3][1])
    walks = [_walk(backend_for(n).constraint([g], VOCAB), ids) for n, g in grammars.items()]
    assert walks[0] == walks[1]
    with pytest.raises(TypeError, match="'llguidance' cannot decode a CompiledGrammar"):
        backend_for("llguidance").constraint([grammars["outlines"]], VOCAB)


def test_llm_answers_under_either_backend(tiny_qwen_vocab, qwen_tok):
    template = ChatTemplate(
        (Path(__file__).parents[1] / "data" / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>"
    )
    tools = [{"type": "function", "function": f} for f in (BOOKING, WEATHER)]
    body = {"messages": [{"role": "user", "content": "Book a seat"}], "temperature": 0, "max_tokens": 48}
    schemas = {f["name"]: f["parameters"] for f in (BOOKING, WEATHER)}

    def llm(backend: str) -> LLM:
        return LLM(
            tiny_qwen_vocab, tokenizer=qwen_tok, chat_template=template, method="pask", budget=0.5, policy=None,
            grammar_backend=backend,
        )  # fmt: skip

    with pytest.raises(RequestError, match="prefixItems|minProperties"):
        llm("outlines").prepare(body | {"tools": tools})
    guided = llm("llguidance")
    single = body | {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
    as_json = body | {"response_format": {"type": "json_schema", "json_schema": {"schema": OBJECT}}}
    called, replied = guided.chat([single, as_json])
    assert called["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = called["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    assert replied["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(replied["choices"][0]["message"]["content"]), OBJECT)
    with pytest.raises(ValueError, match="grammar_backend"):
        LLM(tiny_qwen_vocab, tokenizer=qwen_tok, chat_template=template, method="full", grammar_backend="xgrammar")


def test_objects_that_declare_properties_get_those_keys_only_as_under_ours(qwen_tok):
    """JSON Schema leaves an object open when `additionalProperties` is absent; both backends generate the declared
    keys only (a narrowing: every output is still valid), so a model cannot invent an argument the tool lacks."""
    nested = {"type": "object", "properties": {"limit": {"type": "integer"}}}
    fetch = {"name": "fetch", "description": "", "parameters": {"type": "object", "properties": {"params": nested}}}
    grammar = compile_guidance_grammar([fetch], qwen_tok, parallel=False)

    def turn(arguments: str) -> list[int]:
        return qwen_tok.encode(f'<tool_call>\n{{"name": "fetch", "arguments": {arguments}}}\n</tool_call><|im_end|>')

    assert _accepts(grammar, turn('{"params": {"limit": 5}}'))
    assert not _accepts(grammar, turn('{"params": {"limit": 5}, "page": 2}'))  # an undeclared argument
    assert not _accepts(grammar, turn('{"params": {"limit": 5, "pod": "x"}}'))  # an undeclared key, nested
    with_parts = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert declared_keys_only(copy.deepcopy(with_parts)) == with_parts  # closing a part would refuse the others' keys

"""The tool-call grammar: acceptance of BFCL golds, unchanged BFCL regexes, roles of generated tokens, the
outlines-core defect, tool_choice "auto", response_format grammars, GrammarConstraint.

Compiling an index over Qwen's full 151k-token vocabulary takes about a second per small tool list, so acceptance
tests walk each token sequence through an index built over a *restricted* vocabulary (``small_grammar``): the 256
single-byte tokens (which can spell any regex, so outlines-core accepts the vocabulary) plus the tokens of the texts
under test. That is exact for the question asked: whether a given token sequence is accepted depends only on those
tokens' bytes and the regex, not on which other tokens the vocabulary holds. The roles, the constraint and the
parallel restart are tested on grammars compiled with the full vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from outlines_core import Guide, Index, Vocabulary

from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.dialect import bfcl_function
from pask_jax.experiments.bfcl.prompt import bfcl_python_functions
from pask_jax.models.tokenizer import qwen_tokenizer
from pask_jax.structure import (
    CompiledGrammar,
    GrammarConstraint,
    GrammarError,
    TokenConstraint,
    compile_grammar,
    compile_json_grammar,
    grammar_vocabulary,
    tool_call_regex,
)
from pask_jax.structure import lexer as L
from pask_jax.structure import vocabulary as V
from pask_jax.structure.regex import FRAMINGS, json_regex
from pask_jax.structure.roles import Role
from pask_jax.structure.schema import JSON_OBJECT
from pask_jax.structure.schema_rewrite import enforced_schema

DIGESTS = Path(__file__).parents[1] / "data" / "bfcl_grammar_regex_digests.json"
FACTORIAL = {
    "name": "math.factorial",
    "description": "Calculate the factorial of a number.",
    "parameters": {"type": "dict", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
}
HOTEL = {
    "name": "hotel.book",
    "description": "Book a room.",
    "parameters": {
        "type": "dict",
        "properties": {
            "city": {"type": "string", "description": "Where."},
            "nights": {"type": "integer"},
            "budget": {"type": "float"},
            "pets": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "room": {
                "type": "dict",
                "properties": {"beds": {"type": "integer"}, "view": {"type": "string", "enum": ["sea", "city"]}},
                "required": ["beds"],
            },
            "note": {"type": "any"},
        },
        "required": ["city", "nights"],
    },
}
# Golds that contradict their own function's schema (checked by hand): the grammar cannot produce them.
SCHEMA_VIOLATING_GOLDS = {
    "live_parallel_multiple_2-2-0": "the second call's 'command' is not among the parameter's enum values",
}


@pytest.fixture(scope="module")
def tok(qwen_tok):
    return qwen_tok


@pytest.fixture(scope="module")
def gv(tok):
    return grammar_vocabulary(tok)


def small_grammar(regex: str, gv: V.GrammarVocabulary, token_ids, kind: str = "tool_calls") -> CompiledGrammar:
    """``regex`` over the single-byte tokens + ``token_ids`` (see the module docstring), without role tables."""
    tokens: dict[bytes, list[int]] = {}
    for i in {i for i, raw in enumerate(gv.token_bytes) if len(raw) == 1} | set(token_ids):
        tokens.setdefault(gv.token_bytes[i], []).append(i)
    index = Index(regex, Vocabulary(gv.vocabulary.get_eos_token_id(), tokens))
    return CompiledGrammar(
        index=index, regex=regex, kind=kind, function_names=(), framing="tool_call", parallel=True, vocab=gv,
        edge_roles={}, token_roles={}, state_roles={}, witnesses={}, final_states=frozenset(index.get_final_states()),
        compile_s=0.0, roles_s=0.0,
    )  # fmt: skip


def bfcl_regex(functions, framing="tool_call", parallel=True, gv=None, enums=True, **kwargs) -> str:
    return tool_call_regex([bfcl_function(f, enums=enums) for f in functions], framing, parallel, vocab=gv, **kwargs)


def schema_ordered(value, spec):
    """Arguments in the order their schema declares them (the grammar's order; BFCL golds follow no order)."""
    if isinstance(value, dict) and isinstance(spec, dict) and "properties" in spec:
        props = spec["properties"]
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        return {k: schema_ordered(value[k], props.get(k)) for k in keys}
    if isinstance(value, list) and isinstance(spec, dict) and isinstance(spec.get("items"), dict):
        return [schema_ordered(v, spec["items"]) for v in value]
    return value


def render(calls, framing: str, ensure_ascii: bool = False) -> str:
    """[(name, arguments)] as a whole assistant turn in ``framing`` (json.dumps separators), ending in <|im_end|>."""
    objs = [json.dumps({"name": name, "arguments": args}, ensure_ascii=ensure_ascii) for name, args in calls]
    if framing == "tool_call":
        return "\n".join(f"<tool_call>\n{obj}\n</tool_call>" for obj in objs) + "<|im_end|>"
    return "```json\n" + "\n".join(objs) + "\n```<|im_end|>"


def canonical_text(item, answer, framing) -> str:
    functions = {f["name"]: f for f in item["function"]}
    calls = [
        (name, schema_ordered(args, functions[name]["parameters"]))
        for name, args in bfcl.canonical_calls(answer, item["function"])
    ]
    return render(calls, framing)


# ---- vocabulary --------------------------------------------------------------------------------------------------


def test_vocabulary_special_tokens_are_marker_bytes(tok, gv):
    special = tok.special_tokens
    assert gv.token_bytes[special["<tool_call>"]] == V.CALL_OPEN
    assert gv.token_bytes[special["</tool_call>"]] == V.CALL_CLOSE
    assert gv.token_bytes[special["<|im_end|>"]] == V.END_OF_TURN
    assert gv.end_of_turn_id == special["<|im_end|>"]
    assert gv.call_open_id == special["<tool_call>"] and gv.atomic_calls
    for name in ("<|im_start|>", "<|endoftext|>", "<think>", "<tool_response>"):
        assert gv.token_bytes[special[name]] == b"", name
    # outlines-core's own EOS is a spare id the grammar never allows before the end of turn
    assert gv.vocabulary.get_eos_token_id() == special["<|endoftext|>"]
    assert set(gv.stop_ids) == {special["<|im_end|>"], special["<|endoftext|>"]}
    # no ordinary token keeps a marker byte; ordinary tokens keep their raw bytes
    special_ids = set(special.values())
    assert not any(V.MARKER_BYTES & set(raw) for i, raw in enumerate(gv.token_bytes) if i not in special_ids)
    hello = tok.encode("hello")[0]
    assert gv.token_bytes[hello] == tok.token_bytes(hello)
    assert grammar_vocabulary(tok) is gv  # cached per tokenizer


# ---- BFCL ------------------------------------------------------------------------------------------------------------


def test_bfcl_grammar_regexes_are_unchanged(gv):
    """Every BFCL item's regex (tool_call and json_fence, enums on and off) is the one committed results were
    produced with: its digest is in tests/data. A changed digest changes every number measured on that item."""
    recorded = json.loads(DIGESTS.read_text())
    settings = [(s["framing"], s["enums"]) for s in recorded["settings"]]
    changed = []
    for category in bfcl.CATEGORIES:
        for item in bfcl.load_category(category):
            functions = bfcl_python_functions(item["function"])
            digests = [
                hashlib.sha256(bfcl_regex(functions, framing, gv=gv, enums=enums).encode()).hexdigest()[:16]
                for framing, enums in settings
            ]
            if digests != recorded["digests"].pop(item["id"]):
                changed.append(item["id"])
    assert not changed, f"{len(changed)} BFCL grammars changed, e.g. {changed[:5]}"
    assert not recorded["digests"], "items recorded but no longer in BFCL"


@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_grammar_accepts_bfcl_ground_truth(tok, gv, category):
    """The first 20 items of each category: the canonical gold (first allowed value per argument, optional ones
    omitted, schema key order), in both framings, walks to the end of turn through the item's grammar."""
    answers = bfcl.load_answers(category)
    parallel = "parallel" in category
    for item in bfcl.load_category(category)[:20]:
        for framing in FRAMINGS:
            text = canonical_text(item, answers[item["id"]], framing)
            ids = tok.encode(text)
            grammar = small_grammar(bfcl_regex(item["function"], framing, parallel, gv), gv, ids)
            if item["id"] in SCHEMA_VIOLATING_GOLDS:
                assert not grammar.accepts(ids), item["id"]
                loose = bfcl_regex(item["function"], framing, parallel, gv, enums=False)
                assert small_grammar(loose, gv, ids).accepts(ids), item["id"]
                continue
            assert grammar.accepts(ids), (item["id"], framing, text)
            if framing == "tool_call" or len(bfcl.canonical_calls(answers[item["id"]])) == 1:
                calls = bfcl.parse_tool_calls(tok.decode(ids))  # the harness decodes what the grammar allows
                assert [next(iter(c)) for c in calls] == [n for n, _ in bfcl.canonical_calls(answers[item["id"]])]


def test_grammar_rejects_malformed_calls(tok, gv):
    item = bfcl.load_category("simple_python")[0]  # calculate_triangle_area(base: int, height: int, unit?: str)
    good = '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}'
    bad = {
        "wrong function name": '{"name": "calculate_triangle_areas", "arguments": {"base": 10, "height": 5}}',
        "missing required argument": '{"name": "calculate_triangle_area", "arguments": {"base": 10}}',
        "extra key": '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5, "color": "red"}}',
        "extra envelope key": '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}, "id": 1}',
        "wrong type": '{"name": "calculate_triangle_area", "arguments": {"base": "10", "height": 5}}',
        "float for integer": '{"name": "calculate_triangle_area", "arguments": {"base": 10.5, "height": 5}}',
        "trailing comma": '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5,}}',
        "single quotes": "{'name': 'calculate_triangle_area', 'arguments': {'base': 10, 'height': 5}}",
        "unclosed object": '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}',
        "keys out of order": '{"name": "calculate_triangle_area", "arguments": {"height": 5, "base": 10}}',
        "two spaces": '{"name":  "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}',
        "arguments first": '{"arguments": {"base": 10, "height": 5}, "name": "calculate_triangle_area"}',
    }
    texts = {"good": f"<tool_call>\n{good}\n</tool_call><|im_end|>"}
    texts |= {why: f"<tool_call>\n{call}\n</tool_call><|im_end|>" for why, call in bad.items()}
    texts["no end of turn"] = f"<tool_call>\n{good}\n</tool_call>"
    texts["text before the call"] = f"Sure!\n<tool_call>\n{good}\n</tool_call><|im_end|>"
    texts["second call (not parallel)"] = (
        f"<tool_call>\n{good}\n</tool_call>\n<tool_call>\n{good}\n</tool_call><|im_end|>"
    )
    texts["fence in tool_call framing"] = f"```json\n{good}\n```<|im_end|>"
    encoded = {why: tok.encode(text) for why, text in texts.items()}
    regex = bfcl_regex(item["function"], "tool_call", parallel=False, gv=gv)
    grammar = small_grammar(regex, gv, {i for ids in encoded.values() for i in ids})
    assert grammar.accepts(encoded.pop("good"))
    for why, ids in encoded.items():
        assert not grammar.accepts(ids), why


def test_strings_take_json_escapes_but_not_special_tokens(tok, gv):
    weather = {"name": "w", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    texts = [render([("w", {"city": 'Zürich "old" \\ \n 北京'})], "tool_call", ensure_ascii=True)]  # \uXXXX
    texts.append(render([("w", {"city": "Zürich 北京"})], "tool_call", ensure_ascii=False))  # raw UTF-8
    ids = [tok.encode(text) for text in texts]
    prefix = tok.encode('<tool_call>\n{"name": "w", "arguments": {"city": "Par')
    specials = [tok.special_tokens[name] for name in ("<|im_end|>", "<tool_call>", "</tool_call>", "<|im_start|>")]
    grammar = small_grammar(tool_call_regex([weather], vocab=gv), gv, {i for x in ids for i in x} | set(prefix))
    for x in ids:
        assert grammar.accepts(x), tok.decode(x)
    state = grammar.initial_state
    for token in prefix:
        state = grammar.index.get_next_state(state, token)
    assert state is not None
    for special in specials:  # inside a string no special token is allowed: <|im_end|> would stop mid-string
        assert grammar.index.get_next_state(state, special) is None, tok.decode([special])


# ---- roles of generated tokens ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def factorial(tok):
    return compile_grammar([bfcl_function(FACTORIAL)], tok)


@pytest.fixture(scope="module")
def hotel(tok):
    return compile_grammar([bfcl_function(HOTEL), bfcl_function(FACTORIAL)], tok, parallel=False)


def token_roles(tok, grammar, text):
    ids = tok.encode(text)
    walked = grammar.walk(ids)
    assert walked is not None, text
    roles, complete = walked
    assert complete, text
    return [(tok.decode([i]), Role(r).name) for i, r in zip(ids, roles, strict=True)]


def test_generated_roles_golden_factorial(tok, factorial):
    text = '<tool_call>\n{"name": "math.factorial", "arguments": {"number": 5}}\n</tool_call><|im_end|>'
    assert token_roles(tok, factorial, text) == [
        ("<tool_call>", "FRAMING"),
        ("\n", "FRAMING"),
        ('{"', "STRUCTURAL"),  # the envelope keys are structure, not argument keys
        ("name", "STRUCTURAL"),
        ('":', "STRUCTURAL"),
        (' "', "FUNCTION_NAME"),  # quotes belong to their string
        ("math", "FUNCTION_NAME"),
        (".factor", "FUNCTION_NAME"),
        ("ial", "FUNCTION_NAME"),
        ('",', "STRUCTURAL"),
        (' "', "STRUCTURAL"),
        ("arguments", "STRUCTURAL"),
        ('":', "STRUCTURAL"),
        (' {"', "ARG_KEY"),  # the token's last significant byte opens the argument key
        ("number", "ARG_KEY"),
        ('":', "STRUCTURAL"),
        (" ", "WHITESPACE"),
        ("5", "ARG_NUMBER"),
        ("}}\n", "STRUCTURAL"),  # the same state as a bare "\n" (FRAMING): told apart by the transition
        ("</tool_call>", "FRAMING"),
        ("<|im_end|>", "END_OF_TURN"),
    ]


def test_generated_roles_golden_value_kinds(tok, hotel):
    call = {
        "name": "hotel.book",
        "arguments": {
            "city": "Paris",
            "nights": 3,
            "budget": -12.5,
            "pets": False,
            "tags": ["quiet", "wifi"],
            "room": {"beds": 2, "view": "sea"},
            "note": None,
        },
    }
    roles = token_roles(tok, hotel, f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>")
    assert roles[12:] == [
        (' {"', "ARG_KEY"), ("city", "ARG_KEY"), ('":', "STRUCTURAL"), (' "', "ARG_STRING"), ("Paris", "ARG_STRING"),
        ('",', "STRUCTURAL"), (' "', "ARG_KEY"), ("n", "ARG_KEY"), ("ights", "ARG_KEY"), ('":', "STRUCTURAL"),
        (" ", "WHITESPACE"), ("3", "ARG_NUMBER"), (",", "STRUCTURAL"), (' "', "ARG_KEY"), ("budget", "ARG_KEY"),
        ('":', "STRUCTURAL"), (" -", "ARG_NUMBER"), ("1", "ARG_NUMBER"), ("2", "ARG_NUMBER"), (".", "ARG_NUMBER"),
        ("5", "ARG_NUMBER"), (",", "STRUCTURAL"), (' "', "ARG_KEY"), ("pets", "ARG_KEY"), ('":', "STRUCTURAL"),
        (" false", "ARG_LITERAL"), (",", "STRUCTURAL"), (' "', "ARG_KEY"), ("tags", "ARG_KEY"), ('":', "STRUCTURAL"),
        (' ["', "ARG_STRING"), ("quiet", "ARG_STRING"), ('",', "STRUCTURAL"), (' "', "ARG_STRING"),
        ("wifi", "ARG_STRING"), ('"],', "STRUCTURAL"), (' "', "ARG_KEY"), ("room", "ARG_KEY"), ('":', "STRUCTURAL"),
        (' {"', "ARG_KEY"), ("bed", "ARG_KEY"), ("s", "ARG_KEY"), ('":', "STRUCTURAL"), (" ", "WHITESPACE"),
        ("2", "ARG_NUMBER"), (",", "STRUCTURAL"), (' "', "ARG_KEY"), ("view", "ARG_KEY"), ('":', "STRUCTURAL"),
        (' "', "ARG_STRING"), ("sea", "ARG_STRING"), ('"},', "STRUCTURAL"), (' "', "ARG_KEY"), ("note", "ARG_KEY"),
        ('":', "STRUCTURAL"),
        (" null", "ARG_LITERAL"),  # "any": ' null' and ' ""' share an edge, so this one is looked up per token
        ("}}\n", "STRUCTURAL"), ("</tool_call>", "FRAMING"), ("<|im_end|>", "END_OF_TURN"),
    ]  # fmt: skip
    assert roles[5:8] == [(' "', "FUNCTION_NAME"), ("hotel", "FUNCTION_NAME"), (".book", "FUNCTION_NAME")]
    # the same edge, another token: an empty string for "note"
    empty = {**call, "arguments": {**call["arguments"], "note": ""}}
    assert token_roles(tok, hotel, f"<tool_call>\n{json.dumps(empty)}\n</tool_call><|im_end|>")[-4][1] == "ARG_STRING"


def test_generated_roles_json_fence_pretty_printed(tok):
    grammar = compile_grammar([bfcl_function(FACTORIAL)], tok, framing="json_fence")
    call = {"name": "math.factorial", "arguments": {"number": 5}}
    text = f"```json\n{json.dumps(call, indent=2)}\n{json.dumps(call)}\n```<|im_end|>"
    roles = token_roles(tok, grammar, text)
    assert roles[:3] == [("```", "FRAMING"), ("json", "FRAMING"), ("\n", "FRAMING")]
    assert roles[3:6] == [("{\n", "STRUCTURAL"), (" ", "WHITESPACE"), (' "', "STRUCTURAL")]  # the indented "name"
    assert roles[-2:] == [("```", "FRAMING"), ("<|im_end|>", "END_OF_TURN")]
    assert [r for t, r in roles if t.strip("\n ") == "math"] == ["FUNCTION_NAME", "FUNCTION_NAME"]


def test_lexer_roles_of_bytes():
    text = '\x02\n{"name": "f", "arguments": {"a": [1, "x"], "b": true}}\n\x03\x04'
    names = [Role(r).name for r in L.lex_roles(text.encode())]
    S, W = "STRUCTURAL", "WHITESPACE"
    spans = [
        ("\x02\n", "FRAMING"), ('{"name":', S), (" ", W), ('"f"', "FUNCTION_NAME"), (",", S), (" ", W),
        ('"arguments":', S), (" ", W), ("{", S), ('"a"', "ARG_KEY"), (":", S), (" ", W), ("[", S), ("1", "ARG_NUMBER"),
        (",", S), (" ", W), ('"x"', "ARG_STRING"), ("],", S), (" ", W), ('"b"', "ARG_KEY"), (":", S), (" ", W),
        ("true", "ARG_LITERAL"), ("}}", S), ("\n\x03", "FRAMING"), ("\x04", "END_OF_TURN"),
    ]  # fmt: skip
    assert "".join(span for span, _ in spans) == text
    expected = [role for span, role in spans for _ in span]
    assert names == expected, list(zip(text, names, expected, strict=True))


def test_lexer_roles_of_a_text_answer_and_a_json_value():
    answer = "Hi {x}\x04"
    assert [Role(r).name for r in L.lex_roles(answer.encode(), L.LEX_AUTO)] == ["FREE_TEXT"] * 6 + ["END_OF_TURN"]
    call = b'\x02\n{"name": "f", "arguments": {}}\n\x03\x04'  # "auto" and a call: as without "auto"
    assert L.lex_roles(call, L.LEX_AUTO) == L.lex_roles(call, L.LEX_CALLS)
    value = '{"k": ["v", 1, null]}\x04'
    names = [Role(r).name for r in L.lex_roles(value.encode(), L.LEX_JSON)]
    S = "STRUCTURAL"
    spans = [
        ("{", S), ('"k"', "ARG_KEY"), (":", S), (" ", "WHITESPACE"), ("[", S), ('"v"', "ARG_STRING"), (",", S),
        (" ", "WHITESPACE"), ("1", "ARG_NUMBER"), (",", S), (" ", "WHITESPACE"), ("null", "ARG_LITERAL"), ("]}", S),
        ("\x04", "END_OF_TURN"),
    ]  # fmt: skip
    assert names == [role for span, role in spans for _ in span]
    assert [Role(r).name for r in L.lex_roles(b'"s"\x04', L.LEX_JSON)] == ["ARG_STRING"] * 3 + ["END_OF_TURN"]
    state, _ = L.lex_step(L.LEX_JSON, ord("{"))
    assert state.stack[-1] == L.Frame("obj", "key", None)  # states are named, comparable values


# ---- parallel calls and the outlines-core 0.2.14 defect -----------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="outlines-core 0.2.14 drops transitions out of a final state (fixed upstream, unreleased). If this XPASSes, "
    "a fixed release is installed: the end-of-turn-in-regex workaround in structure/regex.py can be revisited.",
)
def test_outlines_core_defect_raw_library():
    vocab = Vocabulary(9, {"x": [0], ",": [1], ",x": [2]})
    guide = Guide(Index("x(,x)*", vocab))
    guide.advance(0, return_tokens=False)  # "x": a complete match, and a final state
    assert 1 in guide.get_tokens(), "',' continues 'x' to 'x,x' but outlines-core refuses it"


@pytest.mark.xfail(strict=True, reason="outlines-core 0.2.14 defect: a second call is refused without the workaround")
def test_outlines_core_defect_on_repeated_calls(tok, gv):
    text = render([("math.factorial", {"number": 5}), ("math.factorial", {"number": 6})], "tool_call")
    ids = tok.encode(text.removesuffix("<|im_end|>"))
    workaround = bfcl_regex([FACTORIAL], gv=gv, host_repeat=False)
    no_workaround = workaround.removesuffix(gv.end_of_turn)  # call (\n call)*, final after each call
    grammar = small_grammar(no_workaround, gv, ids)
    state = grammar.initial_state
    for token in ids:
        state = grammar.index.get_next_state(state, token)
        assert state is not None, f"refused {tok.decode([token])!r}"


def test_parallel_calls_with_the_workaround(tok, gv, factorial):
    calls = [("math.factorial", {"number": n}) for n in (5, 16, 7)]
    texts = {k: tok.encode(render(calls[:k], "tool_call")) for k in (1, 2, 3)}
    # (1) whole-language regex, end of turn inside it: no state is final before the end
    whole = small_grammar(bfcl_regex([FACTORIAL], gv=gv, host_repeat=False), gv, texts[3])
    assert all(whole.accepts(ids) for ids in texts.values())
    # (2) what compile_grammar builds: one call + (separator | end), the host restarts after the separator
    assert factorial.regex.endswith(r"\n\x03(?:\n|\x04)")
    for k, ids in texts.items():
        roles, complete = factorial.walk(ids)
        assert complete, k
        assert roles.count(Role.END_OF_TURN) == 1 and roles.count(Role.FUNCTION_NAME) == 4 * k
        assert roles.count(Role.ARG_NUMBER) == {1: 1, 2: 3, 3: 4}[k]  # digits are single tokens: 5 | 1 6 | 7
    assert not factorial.accepts(tok.encode("<|im_end|>"))  # zero calls
    after_separator = texts[2][:-1] + tok.encode("\n")
    assert factorial.accepts(after_separator + tok.encode("<|im_end|>"))  # the model's "\n" before the end
    assert factorial.walk(after_separator + tok.encode("hello")) is None  # a separator must start a call
    assert factorial.walk(after_separator + tok.encode("\n<|im_end|>")) is None
    single = compile_grammar([bfcl_function(FACTORIAL)], tok, parallel=False)
    assert single.accepts(texts[1]) and not single.accepts(texts[2])
    assert not single.accepts(texts[1][:-1] + tok.encode("\n<|im_end|>"))


# ---- tool_choice "auto" and response_format ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto(tok):
    return compile_grammar([bfcl_function(FACTORIAL)], tok, tool_choice="auto")


def test_auto_accepts_a_text_answer_or_calls(tok, auto):
    assert auto.kind == "auto" and auto.function_names == ("math.factorial",)
    answer = tok.encode(" I need a number first: which one? {not a call}<|im_end|>")
    roles, complete = auto.walk(answer)
    assert complete and roles == [Role.FREE_TEXT] * (len(answer) - 1) + [Role.END_OF_TURN]
    assert auto.accepts(tok.encode("<|im_end|>"))  # an empty answer
    calls = tok.encode(render([("math.factorial", {"number": 5}), ("math.factorial", {"number": 6})], "tool_call"))
    roles, complete = auto.walk(calls)
    assert complete and roles.count(Role.FUNCTION_NAME) == 8 and Role.FREE_TEXT not in roles
    one_call = tok.encode(render([("math.factorial", {"number": 5})], "tool_call"))[:-1]
    assert auto.walk(one_call + tok.encode("\nDone.<|im_end|>")) is None  # text after a call
    assert auto.walk(tok.encode("Sure.") + one_call) is None  # text before a call
    native_roles = roles[2 : roles.index(Role.FUNCTION_NAME) + 1]  # past "<tool_call>", "\n"
    # a call the model starts bare or in a json fence is held to the schema, with the call's roles
    for opening, closing in (("", ""), ("```json\n", "\n```")):
        call = '{"name": "math.factorial", "arguments": {"number": 5}}'
        ids = tok.encode(f"{opening}{call}{closing}<|im_end|>")
        roles, complete = auto.walk(ids)
        assert complete and Role.FREE_TEXT not in roles and roles.count(Role.FUNCTION_NAME) == 4
        skip = len(tok.encode(opening))
        assert roles[skip : skip + len(native_roles)] == native_roles
        assert auto.walk(tok.encode(f'{opening}{{"name": "math.factorial", "arguments": {{"n": 5}}}}')) is None
        assert auto.walk(tok.encode(f"{opening}{{not a call}}")) is None
    assert auto.walk(tok.encode("```python\nprint(1)\n```<|im_end|>")) is None  # a fence opens only a call
    assert auto.accepts(tok.encode("Code:\n```python\nprint(1)\n```<|im_end|>"))  # after prose, any fence
    assert auto.accepts(tok.encode("[1] is a citation<|im_end|>"))


def test_auto_constraint_masks_no_text_between_calls(tok, auto):
    call_open = tok.special_tokens["<tool_call>"]
    constraint = GrammarConstraint([auto], tok.vocab_size)
    allowed = unpack(constraint.mask(), tok.vocab_size)[0]
    assert allowed[call_open] and allowed[tok.encode("Hello")[0]] and allowed[auto.vocab.end_of_turn_id]
    for token in tok.encode(render([("math.factorial", {"number": 5})], "tool_call"))[:-1] + tok.encode("\n"):
        constraint.advance(np.asarray([token]))
    allowed = unpack(constraint.mask(), tok.vocab_size)[0]
    assert set(np.flatnonzero(allowed)) == {call_open, auto.vocab.end_of_turn_id}


def test_tool_choice_errors(tok):
    with pytest.raises(GrammarError, match="tool_choice 'none' has no grammar.*decode unconstrained"):
        compile_grammar([bfcl_function(FACTORIAL)], tok, tool_choice="none")
    with pytest.raises(GrammarError, match="'auto' needs framing 'tool_call'"):
        compile_grammar([bfcl_function(FACTORIAL)], tok, tool_choice="auto", framing="json_fence")


def test_json_grammar_roles_and_refusals(tok):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": ["integer", "null"]}}}
    grammar = compile_json_grammar(schema, tok)
    assert grammar.kind == "json" and grammar.function_names == () and grammar.framing is None
    assert token_roles(tok, grammar, '{"city": "Oslo", "days": null}<|im_end|>') == [
        ('{"', "ARG_KEY"), ("city", "ARG_KEY"), ('":', "STRUCTURAL"), (' "', "ARG_STRING"), ("Os", "ARG_STRING"),
        ("lo", "ARG_STRING"), ('",', "STRUCTURAL"), (' "', "ARG_KEY"), ("days", "ARG_KEY"), ('":', "STRUCTURAL"),
        (" null", "ARG_LITERAL"), ("}", "STRUCTURAL"), ("<|im_end|>", "END_OF_TURN"),
    ]  # fmt: skip
    for text in ('{"days": 3, "city": "Oslo"}', '{"city": 3}', '```json\n{"city": "Oslo"}\n```', '{"city": "Oslo"}'):
        end = "" if text == '{"city": "Oslo"}' else "<|im_end|>"  # the last one lacks the end of turn
        assert not grammar.accepts(tok.encode(text + end)), text
    assert compile_json_grammar(dict(schema, description="reworded"), tok) is grammar


def test_json_object_grammar_is_any_shallow_object(tok, gv):
    texts = ['{"a": 1, "b": [true, "x"], "c": null}', "{}", '{"k": "v"}']
    bad = ['["not an object"]', '"text"', '{"deep": {"x": 1}}', '{"a": 1} trailing']
    encoded = {t: tok.encode(t + "<|im_end|>") for t in texts + bad}
    regex = json_regex(enforced_schema(JSON_OBJECT, "response_format"), vocab=gv)
    grammar = small_grammar(regex, gv, {i for ids in encoded.values() for i in ids}, kind="json")
    for text in texts:
        assert grammar.accepts(encoded[text]), text
    for text in bad:
        assert not grammar.accepts(encoded[text]), text


# ---- the constraint ------------------------------------------------------------------------------------------------


def unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[..., :vocab].astype(bool)


def test_grammar_constraint_two_grammars(tok, factorial, hotel):
    from pask_jax.runtime.sampling import unpack_mask

    vocab_size = 151_936  # the model's padded vocabulary: the ids past the tokenizer's are never allowed
    texts = [
        render([("math.factorial", {"number": 12}), ("math.factorial", {"number": 3})], "tool_call"),
        render([("hotel.book", {"city": "Oslo", "nights": 2})], "tool_call"),
    ]
    sequences = [tok.encode(t) for t in texts]
    expected_roles = [factorial.walk(s)[0] for s in sequences[:1]] + [hotel.walk(sequences[1])[0]]
    constraint = GrammarConstraint([factorial, hotel], vocab_size)
    grammars = [factorial, hotel]
    shadows = [Guide(g.index) for g in grammars]
    stop = set(factorial.vocab.stop_ids)
    steps = max(map(len, sequences)) + 2
    between = [False, False]  # right after a parallel-call separator the end of turn is allowed too
    for step in range(steps):
        bits = constraint.mask()
        assert bits.shape == (2, vocab_size // 32) and bits.dtype == np.int32
        allowed = unpack(bits, vocab_size)
        if step == 0:
            assert np.array_equal(np.asarray(unpack_mask(bits, vocab_size)), allowed)  # the engine's bit layout
        tokens = np.zeros(2, np.int64)
        for row in range(2):
            if step < len(sequences[row]):
                want = set(shadows[row].get_tokens()) | (
                    {grammars[row].vocab.end_of_turn_id} if between[row] else set()
                )
                assert set(np.flatnonzero(allowed[row])) == want, (row, step)
                tokens[row] = sequences[row][step]
            else:  # finished: EOS only, and further EOS tokens are accepted
                assert set(np.flatnonzero(allowed[row])) == stop, (row, step)
                tokens[row] = tok.special_tokens["<|im_end|>"]
            assert not allowed[row, tok.vocab_size :].any()
        roles = constraint.advance(tokens)
        for row in range(2):
            if step < len(sequences[row]):
                assert roles[row] == expected_roles[row][step], (row, step)
                shadows[row].advance(int(tokens[row]), return_tokens=False)
                restart = tokens[row] != tok.special_tokens["<|im_end|>"]
                between[row] = bool(restart and shadows[row].get_state() in grammars[row].final_states)
                if between[row]:
                    shadows[row].reset()
            else:
                assert roles[row] == Role.END_OF_TURN
    assert constraint.finished.all()
    timing = constraint.timing()
    assert timing["steps"] == steps and timing["mask_s"] > 0 and timing["advance_s"] > 0


def test_grammar_constraint_is_a_token_constraint(factorial):
    from pask_jax.runtime import rows

    assert isinstance(GrammarConstraint([factorial], factorial.vocab.size), TokenConstraint)
    assert rows.TokenConstraint is TokenConstraint  # the decode loop's protocol is this one


def test_grammar_constraint_refuses_an_unmasked_token(tok, factorial):
    constraint = GrammarConstraint([factorial], tok.vocab_size)
    with pytest.raises(ValueError, match=r"row 0: token .* not allowed .* mask"):
        constraint.advance(np.array(tok.encode("hello")[:1]))
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarConstraint([factorial], 1000)


# ---- caching and errors --------------------------------------------------------------------------------------------


def test_compiled_grammars_are_cached(tok, factorial):
    assert compile_grammar([bfcl_function(FACTORIAL)], tok) is factorial
    reworded = {**FACTORIAL, "description": "Another description: not part of the grammar."}
    assert compile_grammar([bfcl_function(reworded)], qwen_tokenizer()) is factorial  # same vocabulary
    noop = {"name": "noop", "parameters": {"type": "object", "properties": {}}}
    grammar = compile_grammar([noop], tok)
    assert grammar.accepts(tok.encode('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call><|im_end|>'))
    assert grammar is not factorial and compile_grammar([noop], tok, parallel=False) is not grammar


def test_bad_schema_errors(tok):
    lookbehind = {
        "name": "scan",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}}},
    }
    with pytest.raises(GrammarError, match=r"function 'scan': outlines-core cannot compile .*look-around"):
        compile_grammar([bfcl_function(FACTORIAL), lookbehind], tok)
    with pytest.raises(GrammarError, match="unknown framing 'xml'"):
        compile_grammar([bfcl_function(FACTORIAL)], tok, framing="xml")
    with pytest.raises(GrammarError, match="tool list is empty"):
        compile_grammar([], tok)
    with pytest.raises(GrammarError, match=r"function 'math.factorial'.*unknown type 'dict'.*did you mean 'object'"):
        compile_grammar([FACTORIAL], tok)  # a BFCL dict not translated
    with pytest.raises(GrammarError, match="string 'name'.*parse_tools"):
        compile_grammar([{"type": "function", "function": FACTORIAL}], tok)  # an OpenAI tool not parsed


def test_turn_may_end_after_a_separator(tok, factorial):
    """Qwen often writes "\\n" before <|im_end|>: after a separator the constraint allows the end of turn too."""
    from pask_jax.runtime.sampling import unpack_mask

    ids = tok.encode(render([("math.factorial", {"number": 5})], "tool_call"))[:-1] + tok.encode("\n<|im_end|>")
    constraint = GrammarConstraint([factorial], 151_936)
    end = factorial.vocab.end_of_turn_id
    call_open = tok.special_tokens["<tool_call>"]
    for i, token in enumerate(ids):
        allowed = np.asarray(unpack_mask(constraint.mask(), 151_936))[0]
        assert allowed[token], (i, tok.decode([token]))
        if i == len(ids) - 1:  # after the separator: another call or the end
            assert allowed[end] and allowed[call_open] and allowed.sum() == 2
        roles = constraint.advance(np.asarray([token]))
    assert constraint.finished[0] and roles[0] == Role.END_OF_TURN
    assert factorial.walk(ids)[0][-1] == Role.END_OF_TURN  # walk follows the same rule

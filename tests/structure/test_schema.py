"""Tool lists and JSON Schema as users write it: parse_tools, bfcl_function, the enforced schema, and every schema
feature accepted and refused by the grammar.

Feature tests walk handwritten calls through the function's regex over a restricted vocabulary (``small_grammar``
of tests/structure/test_grammar.py: exact for acceptance); the arguments a grammar accepts are validated with
``jsonschema`` against the schema as the user wrote it, and those it refuses are invalid there too (unless the test
says the grammar narrows the schema). One end-to-end test compiles a user tool over the full vocabulary.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from decimal import Decimal

import jsonschema
import numpy as np
import pytest
from outlines_core import Index, Vocabulary
from test_grammar import small_grammar

from pask_jax.experiments.bfcl.dialect import bfcl_function
from pask_jax.structure import GrammarError, call_schema, compile_grammar, parse_tools, tool_call_regex
from pask_jax.structure import schema as S
from pask_jax.structure.constraint import GrammarConstraint
from pask_jax.structure.regex import json_regex
from pask_jax.structure.roles import Role
from pask_jax.structure.schema_rewrite import enforced_schema
from pask_jax.structure.vocabulary import grammar_vocabulary


@pytest.fixture(scope="module")
def tok(qwen_tok):
    return qwen_tok


@pytest.fixture(scope="module")
def gv(tok):
    return grammar_vocabulary(tok)


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def call_ids(tok, name: str, arguments) -> list[int]:
    call = json.dumps({"name": name, "arguments": arguments})
    return tok.encode(f"<tool_call>\n{call}\n</tool_call><|im_end|>")


def check_calls(tok, gv, parameters: dict, good: list, bad: dict, narrowed: dict | None = None) -> None:
    """``good`` arguments are accepted and valid; ``bad`` ones refused and invalid; ``narrowed`` ones refused though
    valid (the grammar allows a subset of the schema there, as documented). Formats are checked too."""
    (function,) = parse_tools([tool("f", parameters)])
    narrowed = narrowed or {}
    cases = [("good", args) for args in good] + list(bad.items()) + list(narrowed.items())
    encoded = [(why, args, call_ids(tok, "f", args)) for why, args in cases]
    regex = tool_call_regex([function], parallel=False, vocab=gv)
    grammar = small_grammar(regex, gv, {i for _, _, ids in encoded for i in ids})
    validator = jsonschema.Draft202012Validator(parameters, format_checker=jsonschema.FormatChecker())
    for why, args, ids in encoded:
        if why == "good":
            assert grammar.accepts(ids), args
            validator.validate(args)
        else:
            assert not grammar.accepts(ids), why
            assert validator.is_valid(args) == (why in narrowed), why


# ---- parse_tools -----------------------------------------------------------------------------------------------------


def test_parse_tools_openai_and_bare_functions():
    weather = {
        "name": "get_weather",
        "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": True,
    }
    parsed = parse_tools([{"type": "function", "function": weather}, {"name": "ping"}])
    assert parsed == [
        {"name": "get_weather", "description": "Weather.", "parameters": weather["parameters"]},
        {"name": "ping", "description": "", "parameters": {"type": "object", "properties": {}}},
    ]
    assert parsed[0]["parameters"] is not weather["parameters"]  # copies
    assert parse_tools([]) == []


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, "tools must be a list"),
        ([{"type": "function", "function": {"description": "x"}}], r"tools\[0\]: a function needs a non-empty string"),
        ([{"type": "retrieval"}], r"tools\[0\]: type 'retrieval' is not supported"),
        ([{"type": "function"}], r"tools\[0\]: a 'function' tool needs a 'function' object"),
        ([{"name": "f", "parameters": {"type": "array"}}], r"tools\[0\] \('f'\): 'parameters' must be a JSON Schema"),
        (
            [{"name": "f", "parameters": {"type": "dict", "properties": {}}}],
            r"'parameters' must.*did you mean type 'object'",
        ),
        ([{"name": "f"}, {"name": "g"}, {"name": "f"}], r"tools\[2\] \('f'\): the name is also tools\[0\]'s"),
        ([{"name": "f", "strict": "yes"}], r"tools\[0\] \('f'\): 'strict' must be a boolean"),
        ([{"name": "f", "description": 3}], r"'description' must be a string"),
        (
            [tool("f", {"type": "object", "properties": {"x": {"not": {"type": "null"}}}})],
            r"function 'f', schema at '#/properties/x': keyword 'not' is refused",
        ),
    ],
)
def test_parse_tools_errors_name_the_tool(tools, message):
    with pytest.raises(GrammarError, match=message):
        parse_tools(tools)


# ---- BFCL's dialect ----------------------------------------------------------------------------------------------


def test_bfcl_function_maps_bfcl_types():
    function = {
        "name": "f",
        "description": "kept",
        "parameters": {
            "type": "dict",
            "properties": {
                "d": {"type": "dict", "properties": {"x": {"type": "float"}}, "required": ["x"]},
                "free": {"type": "dict", "description": "no properties"},
                "t": {"type": "tuple", "items": {"type": "float"}},
                "a": {"type": "array", "items": {"type": "integer"}, "default": []},
                "any": {"type": "any"},
                "b": {"type": "boolean", "optional": True},
                "s": {"type": "string", "format": "date", "enum": ["x", "y"]},
                "arr_enum": {"type": "array", "enum": ["p", "q"]},
                "day": {"type": "string", "format": "date", "maximum": 3},
            },
            "required": ["d", "s"],
        },
    }
    translated = bfcl_function(function)
    assert translated["name"] == "f" and translated["description"] == "kept"
    params = translated["parameters"]
    assert params["type"] == "object" and params["required"] == ["d", "s"]
    props = params["properties"]
    assert props["d"] == {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    assert props["free"] == {"type": "object", "description": "no properties"}
    assert props["t"] == {"type": "array", "items": {"type": "number"}}
    assert props["a"] == {"type": "array", "items": {"type": "integer"}}  # defaults dropped
    assert props["any"] == {} and props["b"] == {"type": "boolean"}
    assert props["s"] == {"enum": ["x", "y"]}  # the enum alone decides
    assert props["arr_enum"] == {"type": "array", "items": {"enum": ["p", "q"]}}
    assert props["day"] == {"type": "string"}  # BFCL's formats and bounds are advisory
    loose = bfcl_function(function, enums=False)["parameters"]["properties"]
    assert loose["s"] == {"type": "string"} and loose["arr_enum"] == {"type": "array"}
    # what the grammar enforces: closed objects, shallow values where BFCL gives no schema
    arguments = call_schema(translated)["properties"]["arguments"]
    assert arguments["additionalProperties"] is False
    assert arguments["properties"]["d"]["additionalProperties"] is False
    assert arguments["properties"]["free"] == {"type": "object", "additionalProperties": S.FREE_DICT_VALUE}
    assert arguments["properties"]["any"] == S.ANY_VALUE
    enforced = call_schema(bfcl_function(function, enums=False))["properties"]["arguments"]["properties"]
    assert enforced["arr_enum"] == {"type": "array", "items": S.FREE_ITEM}
    assert call_schema(translated)["properties"]["name"] == {"const": "f"}
    assert list(call_schema(translated)["properties"]) == ["name", "arguments"]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ({"name": "f", "parameters": {"type": "dict", "properties": {"x": {"type": "str"}}}}, r"'f'.*'x'.*'str'.*use"),
        (
            {
                "name": "f",
                "parameters": {"type": "dict", "properties": {"o": {"type": "dict", "properties": {"y": 3}}}},
            },
            r"'f'.*'o\.y'.*must be a dict",
        ),
        ({"name": "f", "parameters": {"type": "dict", "properties": {"e": {"enum": []}}}}, r"'e'.*enum is empty"),
        ({"name": "f", "parameters": {"type": "dict", "properties": {}, "required": ["z"]}}, r"'f'.*\['z'\]"),
        ({"description": "no name"}, "string 'name'"),
    ],
)
def test_bfcl_function_errors_name_the_function_and_the_fix(function, message):
    with pytest.raises(GrammarError, match=message):
        bfcl_function(function)


# ---- the enforced schema -----------------------------------------------------------------------------------------


def enforced(schema: dict, *, loosen: bool = False) -> dict:
    return enforced_schema(schema, "function 'f'", loosen=loosen)


def test_enforced_schema_rewrites():
    assert enforced({"type": ["string", "null"]}) == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert enforced({"description": "anything", "title": "T"}) == S.ANY_VALUE
    assert enforced({"type": "integer", "multipleOf": 2, "examples": [2]}, loosen=True) == {"type": "integer"}
    assert enforced({"properties": {}}) == S.CLOSED_EMPTY  # the type is inferred from the keyword
    assert enforced({"type": "object", "additionalProperties": False}) == S.CLOSED_EMPTY
    assert enforced({"type": "object", "additionalProperties": {"type": "integer"}}) == {
        "type": "object",
        "additionalProperties": {"type": "integer"},
    }
    assert enforced({"type": "string", "enum": ["a", 1, None]}) == {"enum": ["a"]}  # other types can never match
    assert enforced({"type": "integer", "enum": [1, 2.0, 2.5, True]}) == {"enum": [1, 2.0]}
    assert enforced({"anyOf": [{"type": "integer"}, {"anyOf": [{"const": "x"}, False]}]}) == {
        "anyOf": [{"type": "integer"}, {"const": "x"}]
    }
    assert enforced({"oneOf": [{"type": "integer"}, {"type": "null"}]}) == {
        "anyOf": [{"type": "integer"}, {"type": "null"}]
    }
    assert enforced({"type": "string", "pattern": "^a|b$"}) == {"type": "string", "pattern": "(?:a|b)"}
    assert enforced({"type": "string", "format": "date"}) == {
        "type": "string",
        "pattern": f"(?:{S.FORMAT_PATTERNS['date']})",
    }
    for loose in ("time", "email", "uri", "ipv4"):  # outlines-core has no safe pattern for these
        assert enforced({"type": "string", "format": loose}, loosen=True) == {"type": "string"}
    assert enforced({"allOf": [{"$ref": "#/$defs/n"}], "description": "x", "$defs": {"n": {"type": "null"}}}) == {
        "type": "null"
    }


def test_enforced_schema_inlines_refs_and_cuts_recursion():
    tree = {
        "type": "object",
        "properties": {"root": {"$ref": "#/definitions/node"}},
        "required": ["root"],
        "definitions": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/definitions/node"}},
                },
                "required": ["v"],
            }
        },
    }  # fmt: skip
    node = enforced(tree)["properties"]["root"]
    depth = 0
    while "items" in node["properties"]["kids"]:
        node, depth = node["properties"]["kids"]["items"], depth + 1
    assert depth == S.MAX_REF_DEPTH - 1  # the node is unrolled MAX_REF_DEPTH times
    assert node["properties"]["kids"] == {"type": "array", "maxItems": 0}  # past that its kids stay empty
    assert "$defs" not in json.dumps(enforced(tree)) and "$ref" not in json.dumps(enforced(tree))
    required_loop = {"$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}}}
    with pytest.raises(GrammarError, match=r"no value satisfies the schema within 3 levels of \$ref recursion"):
        enforced({**required_loop, "$ref": "#/$defs/a"})


@pytest.mark.parametrize(
    ("schema", "place", "message"),
    [
        ({"type": "string", "nullable": True}, "#", "unknown keyword 'nullable'"),
        ({"prefixItems": [{"type": "string"}]}, "#", "keyword 'prefixItems' is refused: tuples.* 'llguidance'"),
        ({"allOf": [{"type": "string"}, {"minLength": 2}]}, "#", "'allOf' of several schemas is refused"),
        ({"$ref": "#/$defs/x", "type": "string", "$defs": {"x": {}}}, "#", r"keyword '\$ref' with sibling keywords"),
        (
            {"anyOf": [{"type": "string"}], "minLength": 2},
            "#",
            r"keyword 'anyOf' with sibling keywords \['minLength'\]",
        ),
        ({"$ref": "#/$defs/missing"}, "#", r"\$ref '#/\$defs/missing' points at nothing"),
        ({"$ref": "other.json#/x"}, "#", "\\$ref 'other.json#/x': only local references"),
        ({"type": "dict"}, "#", "unknown type 'dict'.*did you mean 'object'"),
        ({"type": ["string", "string"]}, "#", "'type' must be a type name or a list of distinct ones"),
        ({"type": "string", "pattern": "a", "maxLength": 3}, "#", "'pattern' with 'minLength' / 'maxLength'"),
        ({"type": "string", "format": "uuid", "pattern": "a"}, "#", r"'format' 'uuid' with \['pattern'\]"),
        ({"type": "string", "enum": ["a"], "minLength": 2}, "#", r"'enum' with \['minLength'\]: the enum alone"),
        ({"type": "integer", "enum": ["a"]}, "#", "no enum value has the declared type 'integer'"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "#", "'minItems' is larger than 'maxItems'"),
        ({"type": "array", "maxItems": -1}, "#", "'maxItems' must be a non-negative integer"),
        ({"type": "object", "required": ["a"]}, "#", r"required \['a'\] are not among its properties"),
        ({"properties": {"a": {"type": "string"}}, "required": ["b"]}, "#", r"required \['b'\] are not among"),
        ({"properties": {"a": {"if": {}}}}, "#/properties/a", "keyword 'if' is refused"),
        ({"$defs": {"x": {"not": {}}}, "$ref": "#/$defs/x"}, "#/$defs/x", "keyword 'not' is refused"),
        ({"enum": "abc"}, "#", "'enum' must be a non-empty list"),
    ],
)
def test_enforced_schema_refuses_with_the_keyword_and_place(schema, place, message):
    with pytest.raises(GrammarError, match=rf"^function 'f', schema at '{re.escape(place)}': {message}"):
        enforced(schema)


def test_keyword_table_is_complete():
    statuses = {status for status, _ in S.SCHEMA_KEYWORDS.values()}
    assert statuses == {S.ENFORCED, S.ANNOTATION, S.LOOSENED, S.REFUSED}
    for keyword in ("type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "required", "minItems"):
        assert S.SCHEMA_KEYWORDS[keyword][0] == S.ENFORCED, keyword
    for keyword in S.NUMERIC_BOUNDS:
        assert S.SCHEMA_KEYWORDS[keyword][0] == S.ENFORCED, keyword
    for keyword in ("description", "title", "default", "examples", "$comment", "deprecated", "readOnly"):
        assert S.SCHEMA_KEYWORDS[keyword][0] == S.ANNOTATION, keyword
    for keyword in ("multipleOf", "oneOf", "uniqueItems"):
        assert S.SCHEMA_KEYWORDS[keyword][0] == S.LOOSENED, keyword
    for keyword in ("not", "if", "prefixItems", "patternProperties", "minProperties"):
        assert S.SCHEMA_KEYWORDS[keyword][0] == S.REFUSED, keyword


# ---- each feature through the grammar ----------------------------------------------------------------------------


TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 6},
        "mode": {"enum": ["train", "plane"]},
        "guests": {"type": "array", "items": {"$ref": "#/$defs/guest"}, "minItems": 1, "maxItems": 2},
        "note": {"type": ["string", "null"]},
        "version": {"const": 2},
        "seat": {"anyOf": [{"type": "integer"}, {"enum": ["aisle", "window"]}]},
    },
    "required": ["city", "mode", "guests"],
    "$defs": {
        "guest": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name"],
        }
    },
}  # fmt: skip


def test_nested_refs_enums_type_lists_and_bounds(tok, gv):
    ann = {"name": "Ann"}
    oslo = {"city": "Oslo", "mode": "train", "guests": [ann]}
    check_calls(
        tok,
        gv,
        TRIP,
        good=[
            oslo,
            {"city": "Rome", "mode": "plane", "guests": [ann, {"name": "Bo", "age": 7}], "note": None, "version": 2},
            {"city": "Bern", "mode": "train", "guests": [ann], "note": "late", "seat": 12},
            {"city": "Bern", "mode": "train", "guests": [ann], "seat": "aisle"},
        ],
        bad={
            "wrong enum": {"city": "Oslo", "mode": "bus", "guests": [ann]},
            "missing required": {"city": "Oslo", "mode": "train"},
            "null where not allowed": {"city": None, "mode": "train", "guests": [ann]},
            "too many items": {"city": "Oslo", "mode": "train", "guests": [ann, ann, ann]},
            "too few items": {"city": "Oslo", "mode": "train", "guests": []},
            "$ref'd object with a wrong key": {"city": "Oslo", "mode": "train", "guests": [{"nom": "Ann"}]},
            "$ref'd object missing its required key": {"city": "Oslo", "mode": "train", "guests": [{"age": 3}]},
            "string too short": {"city": "O", "mode": "train", "guests": [ann]},
            "string too long": {"city": "Oslo-Nord", "mode": "train", "guests": [ann]},
            "wrong const": {"city": "Oslo", "mode": "train", "guests": [ann], "version": 3},
            "no anyOf branch": {"city": "Oslo", "mode": "train", "guests": [ann], "seat": "middle"},
            "number for a string-or-null": {"city": "Oslo", "mode": "train", "guests": [ann], "note": 3},
        },
        narrowed={
            "keys out of order": {"mode": "train", "city": "Oslo", "guests": [ann]},
            "an undeclared key (additionalProperties absent = false)": {**oslo, "pets": True},
        },
    )


def test_additional_properties_rules(tok, gv):
    parameters = {
        "type": "object",
        "properties": {
            "free": {"type": "object"},
            "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
            "none": {"type": "object", "additionalProperties": False},
            "open": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        },
    }
    check_calls(
        tok,
        gv,
        parameters,
        good=[{}, {"free": {"x": 1, "y": ["a", None]}, "counts": {"a": 1, "b": 2}, "none": {}, "open": {"a": 1}}],
        bad={
            "non-integer value": {"counts": {"a": "1"}},
            "a key where none are allowed": {"none": {"k": 1}},
        },
        narrowed={
            "deeper than a free-form object's shallow values": {"free": {"x": {"y": 1}}},
            "an extra key next to declared properties": {"open": {"a": 1, "b": 2}},
        },
    )


def test_recursive_ref_format_and_pattern(tok, gv):
    parameters = {
        "type": "object",
        "properties": {
            "tree": {"$ref": "#/$defs/node"},
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "either": {"type": "string", "pattern": "ab|cd"},
        },
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["v"],
            }
        },
    }  # fmt: skip
    leaf = {"v": 3}
    deep = {"tree": {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": [leaf]}]}]}}
    check_calls(
        tok,
        gv,
        parameters,
        good=[
            {"tree": {"v": 1, "kids": [{"v": 2, "kids": [leaf]}, leaf]}},
            {"day": "2024-02-29", "id": "123e4567-e89b-12d3-a456-426614174000", "code": "OSL", "either": "cd"},
        ],
        bad={
            "a wrong key inside the recursion": {"tree": {"v": 1, "kids": [{"w": 2}]}},
            "not a date": {"day": "29/02/2024"},
            "not a uuid": {"id": "123"},
            "pattern": {"code": "OSLO"},
        },
        narrowed={
            "deeper than the unrolled recursion": deep,
            "a pattern matched anywhere (the grammar anchors it)": {"either": "xabx"},
        },
    )  # fmt: skip


def test_loosened_keywords_are_not_enforced(tok, gv):
    """A loosened keyword, opted in to, is dropped: the grammar accepts a value the schema refuses."""
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2, "description": "count"}}}
    (function,) = parse_tools([tool("f", parameters)], check_schemas=False)
    ids = call_ids(tok, "f", {"n": 3})
    regex = tool_call_regex([function], parallel=False, vocab=gv, loosen=True)
    assert small_grammar(regex, gv, ids).accepts(ids)
    assert not jsonschema.Draft202012Validator(parameters).is_valid({"n": 3})
    assert S.SCHEMA_KEYWORDS["multipleOf"][0] == S.LOOSENED


def test_numeric_bounds_in_a_tool_call(tok, gv):
    parameters = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 1, "maximum": 12},
            "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
            "t": {"anyOf": [{"type": "integer"}, {"type": "null"}], "exclusiveMaximum": -3},
        },
    }
    check_calls(
        tok,
        gv,
        parameters,
        good=[{"n": 1, "x": 1.5, "t": -4}, {"n": 12, "x": 0.001, "t": None}, {"x": 1.49999, "t": -300}],
        bad={
            "integer below minimum": {"n": 0},
            "integer above maximum": {"n": 13},
            "negative integer": {"n": -1},
            "number at an exclusive minimum": {"x": 0},
            "number just above maximum": {"x": 1.5001},
            "integer at an exclusive maximum, through anyOf": {"t": -3},
        },
        narrowed={"a bounded number with an exponent": {"x": 1e-07}},  # json.dumps writes 1e-07
    )


# ---- numeric bounds against jsonschema ---------------------------------------------------------------------------

_BYTES = Vocabulary(256, {bytes([i]): [i] for i in range(256)})
_JSON_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def byte_grammar(schema: dict):
    """The ``response_format`` grammar of ``schema`` over the 256 single bytes -> accepts(text) (a whole output)."""
    index = Index(json_regex(enforced_schema(schema, "response_format")), _BYTES)
    final = set(index.get_final_states())

    def accepts(text: str) -> bool:
        state = index.get_initial_state()
        for byte in text.encode() + b"\x04":
            state = index.get_next_state(state, byte)
            if state is None:
                return False
        return state in final

    return accepts


def check_bounds_exactly(schema: dict, texts: list[str]) -> None:
    """Each number text is accepted iff jsonschema finds it valid, read exactly (Decimal for both the schema's and
    the instance's decimals); the grammar's narrowings (no exponent when bounded, integers without a fraction) are
    the only exceptions and are checked as such."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    validator = jsonschema.Draft202012Validator(exact)
    shape = _JSON_INTEGER if schema.get("type") == "integer" else _JSON_NUMBER
    try:
        accepts = byte_grammar(schema)
    except GrammarError as exc:  # refused only when the bounds leave no value at all
        assert "no value satisfies" in str(exc), schema
        valid = [t for t in texts if shape.fullmatch(t) and validator.is_valid(json.loads(t, parse_float=Decimal))]
        assert valid == [], (schema, valid[:10])
        return
    wrong = []
    for text in texts:
        if not shape.fullmatch(text):  # not a JSON number of that type as the grammar writes it: refused
            expected = False
        elif re.search("[eE]", text):
            expected = False  # bounded numbers are written without an exponent
        else:
            expected = validator.is_valid(json.loads(text, parse_float=Decimal))
        if accepts(text) != expected:
            wrong.append(text)
    assert wrong == [], (schema, wrong[:10])


def number_texts(points: list[Decimal]) -> list[str]:
    """Number texts around each point: the point and its neighbours in several spellings."""
    texts = {"-0", "-0.0", "0.000", "00", "01", "-01", "+1", "1.", ".5", "1e2", "1E+2", "-2e-3", "1.5e1", "- 1"}
    for point in points:
        for step in (Decimal(0), Decimal(1), Decimal("0.1"), Decimal("0.01"), Decimal("0.001"), Decimal("0.5")):
            for value in (point - step, point + step):
                text = format(value, "f")
                texts |= {text, text + "0", text + "00001"} if "." in text else {text, text + ".0", text + ".5"}
    return sorted(texts)


_GRID = [0, 1, -1, 7, -7, 10, 99, -100, 0.5, -0.5, 2.25, 0.05, 3.0]


@pytest.mark.parametrize("kind", ["integer", "number"])
def test_numeric_bounds_match_jsonschema_on_a_grid(kind):
    """Every lower / upper / exclusive combination of grid values, and number texts around the bounds."""
    points = [Decimal(repr(v)) for v in _GRID]
    texts = number_texts(points) + [str(i) for i in range(-120, 121)]
    for low, high in itertools.product([None, *_GRID], repeat=2):
        for low_key, high_key in itertools.product(("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            schema = {"type": kind}
            if low is not None:
                schema[low_key] = low
            if high is not None:
                schema[high_key] = high
            if low is None and high is None or (low is not None and high is not None and low > high):
                continue
            check_bounds_exactly(schema, texts)


def test_numeric_bounds_match_jsonschema_on_random_bounds():
    """Seeded random decimal bounds (up to 3 places, both signs), numbers near them and at random."""
    rng = random.Random(7)

    def decimal() -> Decimal:
        return Decimal(rng.randint(-5000, 5000)).scaleb(-rng.randint(0, 3))

    for _ in range(60):
        kind = rng.choice(["integer", "number"])
        low, high = sorted([decimal(), decimal()])
        schema: dict = {"type": kind}
        if rng.random() < 0.8:
            schema[rng.choice(["minimum", "exclusiveMinimum"])] = float(low) if low % 1 else int(low)
        if rng.random() < 0.8 or len(schema) == 1:
            schema[rng.choice(["maximum", "exclusiveMaximum"])] = float(high) if high % 1 else int(high)
        texts = number_texts([low, high]) + [format(decimal(), "f") for _ in range(100)]
        check_bounds_exactly(schema, texts)


def test_numeric_bounds_with_other_keywords():
    assert enforced({"type": "integer", "minimum": 2, "maximum": 5}) == {"type": "integer", "minimum": 2, "maximum": 5}
    assert enforced({"minimum": 0, "exclusiveMinimum": 0, "maximum": 3.5, "type": "number"}) == {
        "type": "number",
        "exclusiveMinimum": 0,  # the tighter of the two lower bounds
        "maximum": 3.5,
    }
    assert enforced({"type": "integer", "minimum": 1, "exclusiveMinimum": True}) == {
        "type": "integer",
        "exclusiveMinimum": 1,
    }  # draft 4's boolean form
    assert enforced({"anyOf": [{"type": "integer"}, {"type": "string"}], "maximum": 9}) == {
        "anyOf": [{"type": "integer", "maximum": 9}, {"type": "string"}]  # bounds leave other types alone
    }
    assert enforced({"enum": [1, 5, "a", 2.5], "maximum": 3}) == {"enum": [1, "a", 2.5]}
    assert enforced({"$ref": "#/$defs/n", "minimum": 4, "$defs": {"n": {"type": "integer", "minimum": 2}}}) == {
        "type": "integer",
        "minimum": 4,
    }
    accepts = byte_grammar({"minimum": 3})  # no type: numbers bounded, anything else free
    assert accepts('"x"') and accepts("[1, 2]") and accepts("3") and not accepts("2.5")
    with pytest.raises(GrammarError, match="no value satisfies"):
        enforced({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2})


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "integer", "minimum": "3"}, "'minimum' must be a number, got '3'"),
        ({"type": "number", "maximum": None}, "'maximum' must be a number, got None"),
        ({"type": "number", "minimum": True}, "'minimum' must be a number, got True"),
        ({"type": "number", "maximum": 1e300}, "'maximum' 1e\\+300 is refused: it has more than 40 digits"),
        ({"type": "number", "minimum": float("inf")}, "'minimum' inf is refused: it is not a finite number"),
    ],
)
def test_malformed_numeric_bounds_are_refused(schema, message):
    with pytest.raises(GrammarError, match=rf"^function 'f', schema at '#': {message}"):
        enforced(schema)


def test_user_tool_end_to_end(tok):
    """An OpenAI tool over the full vocabulary: parsed, compiled, walked with roles; two tools, one call each."""
    tools = parse_tools([
        tool("lookup", {
            "type": "object",
            "properties": {"who": {"$ref": "#/$defs/person"}, "when": {"type": ["integer", "null"]}},
            "required": ["who"],
            "$defs": {
                "person": {"type": "object", "properties": {"name": {"enum": ["ann", "bo"]}}, "required": ["name"]}
            },
        }),
        {"name": "ping", "description": "No arguments."},
    ])  # fmt: skip
    grammar = compile_grammar(tools, tok, parallel=False)
    assert grammar.function_names == ("lookup", "ping") and grammar.kind == "tool_calls"
    ids = call_ids(tok, "lookup", {"who": {"name": "bo"}, "when": None})
    roles, complete = grammar.walk(ids)
    assert complete
    named = {tok.decode([t]): Role(r).name for t, r in zip(ids, roles, strict=True)}
    assert named["who"] == "ARG_KEY" and named["name"] == "ARG_KEY" and named["bo"] == "ARG_STRING"
    assert named[" null"] == "ARG_LITERAL"
    assert grammar.accepts(call_ids(tok, "ping", {}))
    assert not grammar.accepts(call_ids(tok, "lookup", {"who": {"name": "cy"}}))
    assert not grammar.accepts(call_ids(tok, "ping", {"x": 1}))


def test_property_names_needing_json_escapes_are_refused():
    for name in ('a"b', "back\\slash", "new\nline"):
        schema = {"type": "object", "properties": {name: {"type": "string"}}}
        with pytest.raises(GrammarError, match="'properties' names .* need JSON escapes"):
            enforced_schema(schema, "function 'f'")
    assert enforced_schema({"type": "object", "properties": {"café ok": {"type": "string"}}}, "function 'f'")


def test_a_json_answer_over_a_tokenizer_without_call_tokens(tok, gv):
    """``response_format`` needs no <tool_call> token: the constraint is built and masks the walk (SmolLM2's case)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
    ids = tok.encode('{"n": 3}<|im_end|>')
    plain = dataclasses.replace(gv, call_open_id=None)
    grammar = small_grammar(json_regex(enforced_schema(schema, "response_format"), vocab=plain), plain, ids, "json")
    constraint = GrammarConstraint([grammar], plain.size)
    for token in ids:
        assert constraint.mask()[0].view(np.uint32)[token >> 5] >> (token & 31) & 1, tok.decode([token])
        constraint.advance(np.array([token]))
    assert constraint.finished[0]

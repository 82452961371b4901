"""The JSON Schema the grammar enforces: which keywords do what, and the rules where JSON Schema leaves a choice.

``schema_rewrite.enforced_schema`` rewrites a schema into the subset outlines-core 0.2.14 compiles faithfully by these
rules; ``tools`` turns OpenAI tool lists into function dicts and their call schemas.

Which keywords do what is the table ``SCHEMA_KEYWORDS`` (keyword -> (status, note)): ENFORCED keywords are
compiled into the grammar; LOOSENED ones are dropped (annotations such as ``description``, and constraints the
grammar does not enforce, such as ``multipleOf``: the grammar then allows values the schema refuses, so check them
after parsing); REFUSED ones, and keywords absent from the table, raise ``GrammarError`` naming the keyword,
where it is and the function. Rules where JSON Schema leaves a choice:

- Keys are written in the order ``properties`` declares them (outlines-core's order); optional ones may be left out.
- ``additionalProperties`` absent means false when ``properties`` is declared (no keys but the declared ones; OpenAI's
  strict mode requires false, and an open object multiplies the automaton). With ``properties`` declared, ``true``
  or a schema also generates the declared keys only (a narrowing: every output is still valid). An object without
  ``properties`` is free-form unless ``additionalProperties`` is false (then ``{}``) or a schema (the values' schema).
- Values without a schema are shallow (each container level multiplies the automaton): ``{}`` / ``true`` is a
  scalar, a list of scalars or an object of scalars (``ANY_VALUE``); the values of a free-form object and the items
  of an array without ``items`` are scalars or lists of scalars (``FREE_DICT_VALUE``, ``FREE_ITEM``).
- ``$ref`` (local: ``#/$defs/...``, ``#/definitions/...``, any pointer into the same schema) is inlined; a recursive
  reference is unrolled ``MAX_REF_DEPTH`` (3) times, and past that a value that needs another level is not
  generated: an optional property is left out, an array stays empty, an ``anyOf`` branch is dropped (a narrowing;
  ``GrammarError`` when nothing is left).
- A type without a ``type`` keyword is inferred from type-specific keywords (``properties`` -> object, ``items`` ->
  array, ``pattern`` -> string, ...); ``enum`` / ``const`` values of another type than the declared one are dropped.
- ``$ref``, ``anyOf``, ``oneOf`` and ``allOf`` (of one schema) take no constraining sibling keywords; ``enum`` /
  ``const`` none but ``type``. Numeric bounds are the exception: they apply to every number the schema allows (the
  ``integer`` / ``number`` branches, ``enum`` / ``const`` values out of range dropped) and leave other types alone,
  as JSON Schema says; the enforced schema carries them on its ``integer`` / ``number`` nodes, at most one lower and
  one upper bound each, and ``regex.schema_regex`` writes them as exact ranges (``numbers.py``; a bounded number has
  no exponent). A boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` (draft 4) makes ``minimum`` / ``maximum``
  exclusive.
"""

from __future__ import annotations


class GrammarError(ValueError):
    """A tool list, schema or tokenizer cannot be turned into a grammar; the message names the cause and the fix."""


ENFORCED, LOOSENED, REFUSED = "enforced", "loosened", "refused"
GUIDANCE_HINT = "grammar_backend 'llguidance' enforces more keywords"  # the other backend, said where ours refuses
MAX_REF_DEPTH = 3  # how many times one recursive $ref is unrolled
ENFORCED_FORMATS = ("date", "date-time", "uuid")
_ANNOTATION = (LOOSENED, "an annotation: nothing to enforce")
_BOUND_NOTE = "exact for any finite decimal bound; a bounded number is written without an exponent"
SCHEMA_KEYWORDS: dict[str, tuple[str, str]] = {
    "type": (ENFORCED, 'a type name or a list of them ("null" included)'),
    "enum": (ENFORCED, "values of any JSON type; values of another type than a declared 'type' are dropped"),
    "const": (ENFORCED, "a value of any JSON type"),
    "properties": (ENFORCED, "keys written in declaration order"),
    "required": (ENFORCED, "names among 'properties'"),
    "additionalProperties": (ENFORCED, "absent = false when 'properties' is declared (see the module docstring)"),
    "items": (ENFORCED, "one schema for every item; absent = shallow values"),
    "minItems": (ENFORCED, ""),
    "maxItems": (ENFORCED, ""),
    "minLength": (ENFORCED, "not together with 'pattern' (outlines-core would drop the pattern)"),
    "maxLength": (ENFORCED, "not together with 'pattern' (outlines-core would drop the pattern)"),
    "pattern": (
        ENFORCED,
        "matched, anchored at both ends, against the string's JSON text between the quotes: a pattern that admits "
        '" or \\ can produce invalid JSON',
    ),
    "format": (
        ENFORCED,
        f"only {', '.join(ENFORCED_FORMATS)} (the shape of each field, not the calendar; date-time's zone is "
        "optional 'Z'); other formats are loosened: outlines-core 0.2.14 has no pattern for most, and its patterns "
        'for time, email and uri admit " or a lone \\ inside the string',
    ),
    "anyOf": (ENFORCED, "no constraining sibling keywords"),
    "allOf": (ENFORCED, "of exactly one schema (as pydantic writes a $ref with a description); no siblings"),
    "$ref": (ENFORCED, f"local references, inlined; recursion unrolled {MAX_REF_DEPTH} times; no siblings"),
    "$defs": (ENFORCED, "where $ref looks"),
    "definitions": (ENFORCED, "where $ref looks"),
    "oneOf": (LOOSENED, "compiled as anyOf: a value matching several branches is accepted"),
    "minimum": (ENFORCED, _BOUND_NOTE),
    "maximum": (ENFORCED, _BOUND_NOTE),
    "exclusiveMinimum": (ENFORCED, f"{_BOUND_NOTE}; a boolean (draft 4) makes 'minimum' exclusive"),
    "exclusiveMaximum": (ENFORCED, f"{_BOUND_NOTE}; a boolean (draft 4) makes 'maximum' exclusive"),
    "multipleOf": (LOOSENED, "not enforced: the grammar allows any number in range; check after parsing"),
    "uniqueItems": (LOOSENED, "not enforced: repeated items are not prevented"),
    "title": _ANNOTATION,
    "description": _ANNOTATION,
    "default": _ANNOTATION,
    "examples": _ANNOTATION,
    "deprecated": _ANNOTATION,
    "readOnly": _ANNOTATION,
    "writeOnly": _ANNOTATION,
    "$comment": _ANNOTATION,
    "$schema": _ANNOTATION,
    "$id": _ANNOTATION,
    "contentEncoding": _ANNOTATION,
    "contentMediaType": _ANNOTATION,
    "not": (REFUSED, "negation has no regular-expression form here"),
    "if": (REFUSED, "conditionals are not supported"),
    "then": (REFUSED, "conditionals are not supported"),
    "else": (REFUSED, "conditionals are not supported"),
    "prefixItems": (REFUSED, "tuples are not supported; use 'items'"),
    "additionalItems": (REFUSED, "tuples are not supported; use 'items'"),
    "contains": (REFUSED, "not supported"),
    "minContains": (REFUSED, "not supported"),
    "maxContains": (REFUSED, "not supported"),
    "patternProperties": (REFUSED, "not supported; declare 'properties' or an 'additionalProperties' schema"),
    "propertyNames": (REFUSED, "not supported"),
    "minProperties": (REFUSED, "not supported"),
    "maxProperties": (REFUSED, "not supported"),
    "dependentRequired": (REFUSED, "not supported"),
    "dependentSchemas": (REFUSED, "not supported"),
    "dependencies": (REFUSED, "not supported"),
    "unevaluatedProperties": (REFUSED, "not supported; 'additionalProperties' is"),
    "unevaluatedItems": (REFUSED, "not supported"),
    "$anchor": (REFUSED, "reference by JSON pointer ('#/$defs/name') instead"),
    "$dynamicRef": (REFUSED, "not supported"),
    "$dynamicAnchor": (REFUSED, "not supported"),
}
NUMERIC_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
# Type names other tool dialects and Python use, with the JSON Schema type meant: named in the error that refuses them.
TYPE_ALIASES = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "list": "array",
    "bool": "boolean",
    "int": "integer",
    "str": "string",
}

_SCALAR = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}
_FLAT = {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}]}
# Values without a schema are kept shallow: every container level multiplies the automaton. Tool calls rarely need
# more ("any" values are scalars; free-form dicts map keys to scalars or lists of scalars). outlines-core turns the
# empty schema {} into an unparenthesised alternation that breaks the surrounding regex, so "any" is spelled out.
ANY_VALUE = {
    "anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]
}
FREE_DICT_VALUE = _FLAT  # values of an object without properties
FREE_ITEM = _FLAT  # items of an array without items
JSON_OBJECT = {"type": "object"}  # response_format json_object: a free-form object (values FREE_DICT_VALUE)
CLOSED_EMPTY = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}

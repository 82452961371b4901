"""The JSON Schema the grammar enforces: which keywords do what, and the rules where JSON Schema leaves a choice.

``schema_rewrite.enforced_schema`` rewrites a schema into the subset outlines-core 0.2.14 compiles faithfully by these
rules; ``tools`` turns OpenAI tool lists into function dicts and their call schemas.

Which keywords do what is the table ``SCHEMA_KEYWORDS`` (keyword -> (status, note)): ENFORCED keywords are
compiled into the grammar; ANNOTATION keywords (``description``, ``title``, ``examples``, ...) constrain nothing and
are dropped, which is exact; LOOSENED ones are constraints the grammar does not enforce (``multipleOf``,
``uniqueItems``, ``oneOf`` whose branches can overlap; likewise a ``format`` other than ``ENFORCED_FORMATS`` on a
value that may be a string; ``uniqueItems: false`` and ``multipleOf: 1`` on integers constrain nothing and are exact):
a schema using one is refused with ``Unenforceable`` (a ``GrammarError``) naming the keyword, where it is and
whether llguidance enforces it (``GUIDANCE_ENFORCED``, ``GUIDANCE_FORMATS``), unless the caller opts in to the
loosening (``enforced_schema(..., loosen=True)``; ``grammar_backend="outlines-loose"``), which drops them (the
grammar then allows values the schema refuses: check them after parsing). REFUSED ones, and keywords absent from
the table, raise ``Unenforceable`` always. Rules where JSON Schema leaves a choice:

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
- ``oneOf`` is compiled as ``anyOf``, which is exact when no value matches two branches: branches of different JSON
  types, ``enum`` / ``const`` branches without a common value, or object branches with a common required property
  whose values cannot be equal (a tagged union); ``oneOf`` branches that may overlap are LOOSENED.
- ``format`` values are written as patterns (``FORMAT_PATTERNS``): the calendar is exact (days per month, 29
  February in leap years), ``date-time`` needs its zone (``Z`` or ``+hh:mm``), as RFC 3339 says; ``T`` and ``Z`` are
  upper case and a ``uuid`` lower case (a narrowing).
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


class Unenforceable(GrammarError):
    """A schema our translation cannot enforce exactly (a REFUSED or unknown keyword, a LOOSENED constraint, a
    construct it refuses), though the schema itself is well formed: grammar_backend "auto" gives it to llguidance."""


ENFORCED, ANNOTATION, LOOSENED, REFUSED = "enforced", "annotation", "loosened", "refused"
GUIDANCE_HINT = "grammar_backend 'llguidance' enforces more keywords"  # the other backend, said where ours refuses
# The LOOSENED constraints llguidance 1.9.1 enforces (it refuses uniqueItems, a oneOf whose branches overlap and
# formats it does not know): where ours refuses one, the error says whether grammar_backend 'llguidance' takes it.
GUIDANCE_ENFORCED = ("multipleOf",)
GUIDANCE_FORMATS = ("duration", "email", "hostname", "ipv4", "ipv6", "time", "uri")
LOOSE_HINT = "'outlines-loose' drops it, allowing values the schema refuses"  # the explicit opt-in to the loosening
MAX_REF_DEPTH = 3  # how many times one recursive $ref is unrolled
_DATE = (  # YYYY-MM-DD with the days each month has; 29 February in leap years only
    "(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)"
)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?"
_OFFSET = "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {  # the formats the grammar enforces, as the patterns of the string's text (RFC 3339, RFC 4122)
    "date": _DATE,
    "date-time": f"{_DATE}T{_TIME}{_OFFSET}",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}
ENFORCED_FORMATS = tuple(FORMAT_PATTERNS)
_ANNOTATION = (ANNOTATION, "nothing to enforce: dropped")
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
        f"only {', '.join(ENFORCED_FORMATS)} (FORMAT_PATTERNS: the calendar exact, date-time's zone required); other "
        "formats are loosened: outlines-core 0.2.14 has no pattern for most, and its patterns for time, email and "
        'uri admit " or a lone \\ inside the string',
    ),
    "anyOf": (ENFORCED, "no constraining sibling keywords"),
    "allOf": (ENFORCED, "of exactly one schema (as pydantic writes a $ref with a description); no siblings"),
    "$ref": (ENFORCED, f"local references, inlined; recursion unrolled {MAX_REF_DEPTH} times; no siblings"),
    "$defs": (ENFORCED, "where $ref looks"),
    "definitions": (ENFORCED, "where $ref looks"),
    "oneOf": (
        LOOSENED,
        "compiled as anyOf: exact where no value matches two branches (see the module docstring), else loosened "
        "(a value matching several branches is accepted)",
    ),
    "minimum": (ENFORCED, _BOUND_NOTE),
    "maximum": (ENFORCED, _BOUND_NOTE),
    "exclusiveMinimum": (ENFORCED, f"{_BOUND_NOTE}; a boolean (draft 4) makes 'minimum' exclusive"),
    "exclusiveMaximum": (ENFORCED, f"{_BOUND_NOTE}; a boolean (draft 4) makes 'maximum' exclusive"),
    "multipleOf": (LOOSENED, "the grammar would allow any number in range"),
    "uniqueItems": (LOOSENED, "the grammar would allow repeated items"),
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

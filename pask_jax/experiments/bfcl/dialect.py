"""BFCL's function dialect -> function dicts with standard JSON Schema parameters (what the library's grammar takes).

BFCL writes parameter types as dict / float / tuple / any and puts an array's enum on the array itself;
`bfcl_function` translates one function.
"""

from __future__ import annotations

from typing import Any

from pask_jax.structure import GrammarError

_BFCL_TYPES = {  # BFCL (and JSON Schema) type name -> JSON Schema type
    "string": "string",
    "integer": "integer",
    "float": "number",
    "number": "number",
    "boolean": "boolean",
    "bool": "boolean",
    "dict": "object",
    "object": "object",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "null": "null",
}
# Kept from a BFCL parameter spec. BFCL's "format" (e.g. "date") is advisory, as are "maximum" and "default";
# ground truths do not always follow them, so they are dropped. What is kept holds no constraint the grammar
# leaves unenforced (SCHEMA_KEYWORDS' LOOSENED): the default translation takes every BFCL function exactly, with no
# "outlines-loose" opt-in (tests/structure/test_grammar.py's regex digests cover every item).
_BFCL_KEPT = ("description", "pattern", "minLength", "maxLength", "minItems", "maxItems")


def _bfcl_param(spec: Any, function: str, path: str, enums: bool) -> dict:
    """One BFCL parameter spec -> JSON Schema; ``function`` / ``path`` ("a.b[]") name it in errors."""
    where = f"function {function!r}, parameter {path!r}"
    if not isinstance(spec, dict):
        raise GrammarError(f"{where}: a parameter spec must be a dict, got {type(spec).__name__}; fix the tool list")
    kind = spec.get("type", "any")
    if "enum" in spec:
        values = list(spec["enum"])
        if not values:
            raise GrammarError(f"{where}: its enum is empty, so no value is allowed; remove the enum or list values")
        if enums and kind in ("array", "list", "tuple"):  # BFCL puts the items' enum on the array itself
            return {"type": "array", "items": {"enum": values}}
        if enums:  # the enum alone decides: BFCL has e.g. type "boolean" with enum ["True", "False", "dontcare"]
            return {"enum": values}
        spec = {k: v for k, v in spec.items() if k != "enum"}
    if kind == "any":
        return {}
    if not isinstance(kind, str) or kind not in _BFCL_TYPES:
        raise GrammarError(
            f"{where}: unsupported type {kind!r}; use one of {sorted(_BFCL_TYPES)} or 'any' (BFCL's types are dict, "
            "float, tuple, any, integer, string, boolean, array)"
        )
    out: dict[str, Any] = {"type": _BFCL_TYPES[kind]}
    out.update((key, spec[key]) for key in _BFCL_KEPT if key in spec)
    if out["type"] == "array" and spec.get("items") is not None:
        out["items"] = _bfcl_param(spec["items"], function, f"{path}[]", enums)
    elif out["type"] == "object" and "properties" in spec:  # without properties: a free-form dict
        out.update(_bfcl_object(spec["properties"], spec.get("required", []), function, f"{path}.", enums))
    return out


def _bfcl_object(properties: Any, required: Any, function: str, prefix: str, enums: bool) -> dict:
    """properties + required of an object whose parameters are named ``prefix + name`` in errors."""
    where = f"function {function!r}" + (f", parameter {prefix[:-1]!r}" if prefix else "")
    if not isinstance(properties, dict):
        raise GrammarError(f"{where}: 'properties' must be a dict of parameter specs; fix the tool list")
    if not isinstance(required, list):
        raise GrammarError(f"{where}: 'required' must be a list of parameter names; fix the tool list")
    unknown = [name for name in required if name not in properties]
    if unknown:
        raise GrammarError(f"{where}: required {unknown} are not among its properties {list(properties)}")
    return {
        "properties": {name: _bfcl_param(p, function, prefix + name, enums) for name, p in properties.items()},
        "required": list(required),
    }


def bfcl_function(function: dict, *, enums: bool = True) -> dict:
    """A BFCL function dict -> a function dict with standard JSON Schema parameters.

    BFCL types map to JSON Schema: dict -> object (free-form if it has no properties), float -> number, tuple ->
    array, any -> ``{}`` (any JSON value, shallow), integer / string / boolean / array kept; required arguments are
    required, optional ones may be omitted, no others are allowed. Descriptions are kept (annotations); formats,
    bounds and defaults are dropped (BFCL's golds do not always follow them). With ``enums`` (default) an enum
    decides the values on its own (BFCL has type "boolean" with enum ["True", "False", "dontcare"]; an array's enum
    is its items'); ``enums=False`` drops enums and keeps the types. Of BFCL's 2,351 golds (rendered canonically, in
    schema key order) the default grammar refuses 21: 7 name a value outside their parameter's enum (accepted with
    ``enums=False``), 14 give a value of another type than their schema declares (``true`` for a string, ``null``
    for an optional string, a list for a string, ...) or are unsatisfiable under BFCL's checker anyway.
    """
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise GrammarError(f"a function must be a dict with a string 'name', got {str(function)[:120]!r}")
    name = function["name"]
    parameters = function.get("parameters", {"type": "dict", "properties": {}})
    if not isinstance(parameters, dict):
        raise GrammarError(f"function {name!r}: 'parameters' must be a dict (a BFCL 'dict' schema); fix the tool list")
    properties, required = parameters.get("properties", {}), parameters.get("required", [])
    return {
        "name": name,
        "description": function.get("description", ""),
        "parameters": {"type": "object", **_bfcl_object(properties, required, name, "", enums)},
    }

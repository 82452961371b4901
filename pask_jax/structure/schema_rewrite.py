"""JSON Schema -> the schema the grammar enforces (``enforced_schema``), by the rules of ``schema``'s docstring.

The rewritten schema is the subset outlines-core 0.2.14 compiles faithfully: ``$ref`` inlined, type lists split into
``anyOf``, defaults made explicit, annotations dropped, formats written as patterns, numeric bounds merged into one
lower and one upper bound per ``integer`` / ``number`` node (``read_bounds``). That rewritten schema is what the
grammar allows, and the compile cache's key. A constraint the grammar does not enforce (LOOSENED) is refused with
``Unenforceable`` before anything is compiled, unless ``loosen=True`` opts in to dropping it.
"""

from __future__ import annotations

import collections
import copy
import itertools
import json
from typing import Any

from pask_jax.structure.numbers import Bound, bounded_regex, check_digits, in_range, to_decimal
from pask_jax.structure.schema import (
    ANNOTATION,
    ANY_VALUE,
    CLOSED_EMPTY,
    FORMAT_PATTERNS,
    FREE_DICT_VALUE,
    FREE_ITEM,
    GUIDANCE_ENFORCED,
    GUIDANCE_FORMATS,
    GUIDANCE_HINT,
    JSON_TYPES,
    LOOSE_HINT,
    LOOSENED,
    MAX_REF_DEPTH,
    NUMERIC_BOUNDS,
    REFUSED,
    SCHEMA_KEYWORDS,
    TYPE_ALIASES,
    GrammarError,
    Unenforceable,
)

_DROPPED = frozenset(k for k, (status, _) in SCHEMA_KEYWORDS.items() if status in (ANNOTATION, LOOSENED)) - {"oneOf"}
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_TYPE_KEYWORDS = {  # keywords that apply to one type only: a schema without "type" gets the types they name
    "object": ("properties", "required", "additionalProperties"),
    "array": ("items", "minItems", "maxItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
}


def _no_op(key: str, schema: dict) -> bool:
    """Whether a LOOSENED keyword constrains nothing here, so dropping it is exact: ``uniqueItems: false``, or
    ``multipleOf: 1`` on integers."""
    if key == "uniqueItems":
        return schema[key] is False
    return key == "multipleOf" and schema[key] == 1 and schema.get("type") == "integer"


def _may_be_string(schema: dict) -> bool:
    """Whether a value of `schema` may be a string: ``format`` constrains strings only (JSON Schema), so on a schema
    typed otherwise (OpenAPI's ``format: int32`` on an integer) dropping it is exact."""
    types = schema.get("type", "string")
    return "string" in ([types] if isinstance(types, str) else types)


class _Rewriter:
    """One pass over one root schema; ``where`` ("function 'f'", "response_format") names it in errors; ``loosen``
    drops the LOOSENED constraints instead of refusing them."""

    def __init__(self, root: Any, where: str, loosen: bool):
        self.root, self.where, self.loosen = root, where, loosen
        self.unrolled: collections.Counter[str] = collections.Counter()  # $ref -> times on the current path

    def error(self, path: str, message: str, kind: type[GrammarError] = GrammarError) -> GrammarError:
        return kind(f"{self.where}, schema at {path!r}: {message}")

    def unsupported(self, path: str, message: str) -> Unenforceable:
        """A well-formed schema our translation cannot enforce exactly."""
        return self.error(path, message, Unenforceable)

    def check_enforced(self, path: str, what: str, note: str, by_guidance: bool) -> None:
        """Refuse a LOOSENED constraint (``what``: the keyword, or a format) unless the caller opted in; the message
        says whether llguidance enforces it (``by_guidance``) and how to opt in."""
        if not self.loosen:
            other = (
                "grammar_backend 'llguidance' (or 'auto') enforces it" if by_guidance else "llguidance refuses it too"
            )
            raise self.unsupported(
                path, f"{what} is not enforced by grammar_backend 'outlines' ({note}): {other}; {LOOSE_HINT}"
            )

    def node(self, schema: Any, path: str) -> dict | None:
        """One schema -> its enforced form, or None when no value is generated (a cut recursion, ``false``)."""
        if schema is True:
            return copy.deepcopy(ANY_VALUE)
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise self.error(path, f"a schema must be an object or a boolean, got {type(schema).__name__}")
        for key in schema:
            status = SCHEMA_KEYWORDS.get(key)
            if status is None:
                raise self.unsupported(
                    path, f"unknown keyword {key!r}; the supported ones are in schema.SCHEMA_KEYWORDS"
                )
            if status[0] == REFUSED:
                raise self.unsupported(path, f"keyword {key!r} is refused: {status[1]} ({GUIDANCE_HINT})")
            if status[0] == LOOSENED and key != "oneOf" and not _no_op(key, schema):  # oneOf: see combinator
                self.check_enforced(path, f"keyword {key!r}", status[1], key in GUIDANCE_ENFORCED)
        if "format" in schema and schema["format"] not in FORMAT_PATTERNS and _may_be_string(schema):
            fmt = schema["format"]
            note = f"the enforced ones are {list(FORMAT_PATTERNS)}"
            self.check_enforced(path, f"'format' {fmt!r}", note, fmt in GUIDANCE_FORMATS)
        if any(k in schema for k in NUMERIC_BOUNDS):
            low, high = read_bounds(schema, lambda message: self.error(path, message))
            unbounded = {k: v for k, v in schema.items() if k not in NUMERIC_BOUNDS}
            return _bounded(self.node(unbounded, path), low, high)
        kept = [k for k in schema if k not in _DROPPED and k not in ("$defs", "definitions")]
        combinators = [k for k in _COMBINATORS if k in schema]
        if combinators:
            if len(kept) > 1:
                raise self.unsupported(
                    path, f"keyword {combinators[0]!r} with sibling keywords {[k for k in kept if k != combinators[0]]}"
                    "; move them into the referenced schema or the branches"
                )  # fmt: skip
            return self.combinator(combinators[0], schema[combinators[0]], path)
        if "enum" in schema or "const" in schema:
            return self.values(schema, kept, path)
        types = schema.get("type")
        if types is None:
            types = [t for t, keys in _TYPE_KEYWORDS.items() if any(k in schema for k in keys)]
            if not types:
                return copy.deepcopy(ANY_VALUE)
        types = self.type_names(types, path)
        branches = [b for b in (self.typed(t, schema, path) for t in types) if b is not None]
        if not branches:
            return None
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def type_names(self, types: Any, path: str) -> list[str]:
        names = [types] if isinstance(types, str) else types
        if not isinstance(names, list) or not names or len(set(map(str, names))) != len(names):
            raise self.error(path, f"'type' must be a type name or a list of distinct ones, got {types!r}")
        for name in names:
            if name not in JSON_TYPES:
                hint = f" (did you mean {TYPE_ALIASES[name]!r}?)" if name in TYPE_ALIASES else ""
                raise self.error(path, f"unknown type {name!r}; JSON Schema's are {list(JSON_TYPES)}{hint}")
        return names

    def combinator(self, keyword: str, value: Any, path: str) -> dict | None:
        if keyword == "$ref":
            return self.ref(value, path)
        if not isinstance(value, list) or not value:
            raise self.error(path, f"{keyword!r} must be a non-empty list of schemas")
        if keyword == "allOf":
            if len(value) != 1:
                raise self.unsupported(path, "'allOf' of several schemas is refused: merge them into one schema")
            return self.node(value[0], f"{path}/allOf/0")
        outs = [self.node(branch, f"{path}/{keyword}/{i}") for i, branch in enumerate(value)]
        if keyword == "oneOf" and not self.one_of_is_exact(value, outs):
            note = "its branches can overlap, and anyOf accepts a value matching several"
            self.check_enforced(path, "keyword 'oneOf'", note, by_guidance=False)
        branches = []
        for out in outs:
            if out is not None:
                branches.extend(out["anyOf"] if list(out) == ["anyOf"] else [out])
        if not branches:
            return None
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def one_of_is_exact(self, branches: list, outs: list[dict | None]) -> bool:
        """Whether ``oneOf`` compiled as ``anyOf`` is exact: no value is valid for two of the branches as written (a
        branch the rewrite cut, a recursion past ``MAX_REF_DEPTH``, is not shown to be apart: not exact)."""
        if any(out is None and branch is not False for branch, out in zip(branches, outs, strict=True)):
            return False
        return all(self.excludes(a, b) for a, b in itertools.combinations(branches, 2))

    def excludes(self, a: Any, b: Any, depth: int = 0) -> bool:
        """Whether no value is valid for both schemas ``a`` and ``b`` (False where that is not shown: conservative):
        different JSON types, enum / const lists without a common value, or a common required property whose values
        exclude each other in two object schemas."""
        if depth > _MAX_EXCLUDES_DEPTH:
            return False
        a, b = self.resolved(a), self.resolved(b)
        for one, other in ((a, b), (b, a)):
            for key in ("anyOf", "oneOf"):
                if isinstance(one, dict) and isinstance(one.get(key), list):
                    return all(self.excludes(branch, other, depth + 1) for branch in one[key])
        types_a, types_b = self.value_types(a, depth), self.value_types(b, depth)
        if not types_a & types_b:
            return True
        values_a, values_b = _listed_values(a), _listed_values(b)
        if values_a is not None and values_b is not None:
            return not any(x == y for x in values_a for y in values_b)  # Python's == also equates 1 / True: cautious
        if types_a == types_b == {"object"}:
            props_a, props_b = a.get("properties", {}), b.get("properties", {})
            common = set(a.get("required", [])) & set(b.get("required", [])) & set(props_a) & set(props_b)
            return any(self.excludes(props_a[k], props_b[k], depth + 1) for k in common)
        return False

    def value_types(self, schema: Any, depth: int = 0) -> frozenset[str]:
        """The JSON types a value valid for ``schema`` may have ("integer" counted as "number")."""
        schema = self.resolved(schema)
        if schema is False:
            return frozenset()
        if not isinstance(schema, dict) or depth > _MAX_EXCLUDES_DEPTH:
            return _ALL_TYPES
        found = _ALL_TYPES
        if "type" in schema:
            names = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
            found &= {"number" if t == "integer" else t for t in names}
        values = _listed_values(schema)
        value_types = {_json_type(v) for v in values or ()}
        if values is not None and None not in value_types:
            found &= value_types
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                found &= frozenset().union(*(self.value_types(s, depth + 1) for s in schema[key]))
        for branch in schema.get("allOf", []):
            found &= self.value_types(branch, depth + 1)
        return found

    def resolved(self, schema: Any) -> Any:
        """``schema`` with a top-level local ``$ref`` followed (a chain of them, a few hops; None past that)."""
        for _ in range(_MAX_EXCLUDES_DEPTH):
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                return schema
            schema = _pointer(self.root, schema["$ref"])
        return None

    def ref(self, ref: Any, path: str) -> dict | None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.unsupported(path, f"$ref {ref!r}: only local references ('#/$defs/name') are supported")
        if self.unrolled[ref] >= MAX_REF_DEPTH:
            return None  # the recursion is cut here
        target = _pointer(self.root, ref)
        if target is None:
            raise self.error(path, f"$ref {ref!r} points at nothing")
        self.unrolled[ref] += 1
        try:
            return self.node(target, ref)
        finally:
            self.unrolled[ref] -= 1

    def values(self, schema: dict, kept: list[str], path: str) -> dict:
        keyword = "enum" if "enum" in schema else "const"
        others = [k for k in kept if k not in (keyword, "type")]
        if others:
            raise self.unsupported(path, f"{keyword!r} with {others}: the {keyword} alone decides; remove {others}")
        if keyword == "enum" and (not isinstance(schema["enum"], list) or not schema["enum"]):
            raise self.error(path, "'enum' must be a non-empty list of values")
        values = list(schema["enum"]) if keyword == "enum" else [schema["const"]]
        if "type" in schema:
            types = self.type_names(schema["type"], path)
            values = [v for v in values if any(_has_type(v, t) for t in types)]
            if not values:
                raise self.error(path, f"no {keyword} value has the declared type {schema['type']!r}")
        return {"enum": values} if keyword == "enum" else {"const": values[0]}

    def typed(self, kind: str, schema: dict, path: str) -> dict | None:
        """The part of ``schema`` that applies to values of type ``kind``."""
        if kind == "string":
            return self.string(schema, path)
        if kind == "array":
            return self.array(schema, path)
        if kind == "object":
            return self.object(schema, path)
        return {"type": kind}

    def string(self, schema: dict, path: str) -> dict:
        out: dict[str, Any] = {"type": "string"}
        for key in ("minLength", "maxLength"):
            if key in schema:
                out[key] = self.count(schema, key, path)
        if out.get("minLength", 0) > out.get("maxLength", out.get("minLength", 0)):
            raise self.error(path, "'minLength' is larger than 'maxLength'")
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise self.error(path, "'pattern' must be a string")
            if len(out) > 1:
                raise self.unsupported(
                    path, "'pattern' with 'minLength' / 'maxLength': fold the length into the pattern"
                )
            # The grammar anchors the pattern anyway; outlines-core pastes it between the quotes as it is, so it
            # is grouped (an alternation would otherwise take a quote into one branch).
            pattern = pattern[1:] if pattern.startswith("^") else pattern
            pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
            out["pattern"] = f"(?:{pattern})"
        fmt = schema.get("format")
        if fmt in FORMAT_PATTERNS:
            if len(out) > 1:
                raise self.unsupported(path, f"'format' {fmt!r} with {[k for k in out if k != 'type']}: choose one")
            out["pattern"] = f"(?:{FORMAT_PATTERNS[fmt]})"
        return out

    def array(self, schema: dict, path: str) -> dict | None:
        out: dict[str, Any] = {"type": "array"}
        for key in ("minItems", "maxItems"):
            if key in schema:
                out[key] = self.count(schema, key, path)
        if out.get("minItems", 0) > out.get("maxItems", out.get("minItems", 0)):
            raise self.error(path, "'minItems' is larger than 'maxItems'")
        if "items" not in schema:
            out["items"] = copy.deepcopy(FREE_ITEM)
            return out
        if isinstance(schema["items"], list):
            raise self.unsupported(path, "'items' as a list (a tuple) is refused: give one schema for every item")
        items = self.node(schema["items"], f"{path}/items")
        if items is not None:
            out["items"] = items
            return out
        if out.get("minItems", 0) > 0:
            return None
        return {"type": "array", "maxItems": 0}  # no item can be generated: the empty array

    def object(self, schema: dict, path: str) -> dict | None:
        properties, required = schema.get("properties"), schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.error(path, "'required' must be a list of property names")
        extra = schema.get("additionalProperties", None if properties is None else False)
        if not isinstance(extra, bool | dict | type(None)):
            raise self.error(path, "'additionalProperties' must be a boolean or a schema")
        if properties is None:
            if required:
                raise self.error(path, f"required {required} are not among its properties (it declares none)")
            if extra is None or extra is True:
                return {"type": "object", "additionalProperties": copy.deepcopy(FREE_DICT_VALUE)}
            values = self.node(extra, f"{path}/additionalProperties") if extra is not False else None
            if values is None:
                return copy.deepcopy(CLOSED_EMPTY)
            return {"type": "object", "additionalProperties": values}
        if not isinstance(properties, dict):
            raise self.error(path, "'properties' must be an object mapping names to schemas")
        unknown = [name for name in required if name not in properties]
        if unknown:
            raise self.error(path, f"required {unknown} are not among its properties {list(properties)}")
        # outlines-core writes a property name into the regex as raw text, not as a JSON string: a name JSON must
        # escape would make the grammar reject valid output and allow invalid JSON
        escaped = [name for name in properties if json.dumps(name, ensure_ascii=False)[1:-1] != name]
        if escaped:
            raise self.unsupported(
                path, f"'properties' names {escaped} need JSON escapes, which the grammar cannot write"
            )
        if isinstance(extra, dict):
            self.node(extra, f"{path}/additionalProperties")  # checked, though only declared keys are generated
        out = {}
        for name, sub in properties.items():
            value = self.node(sub, f"{path}/properties/{name}")
            if value is None and name in required:
                return None
            if value is not None:
                out[name] = value
        return {"type": "object", "properties": out, "required": list(required), "additionalProperties": False}

    def count(self, schema: dict, key: str, path: str) -> int:
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(path, f"{key!r} must be a non-negative integer, got {value!r}")
        return value


_ALL_TYPES = frozenset(JSON_TYPES) - {"integer"}  # "integer" values are "number" values
_MAX_EXCLUDES_DEPTH = 8  # how deep the oneOf check follows references and nested branches before it gives up


def _pointer(root: Any, ref: str) -> Any:
    """What the local reference ``ref`` ("#/$defs/name") points at in ``root``; None when it points at nothing."""
    if not ref.startswith("#"):
        return None
    target = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _listed_values(schema: Any) -> list | None:
    """The values an ``enum`` / ``const`` schema allows (None: not such a schema)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if isinstance(schema.get("enum"), list) else None


def _json_type(value: Any) -> str | None:
    """A JSON value's type ("number" for integers too); None for a Python value JSON has no type for."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", type(None): "null", dict: "object", list: "array"}.get(type(value))


def read_bounds(schema: dict, error: Any = GrammarError) -> tuple[Bound | None, Bound | None]:
    """The tightest lower and upper bound ``schema``'s numeric keywords set (None: none on that side); ``error``
    makes the exception for a malformed bound from its message."""
    lows: list[Bound] = []
    highs: list[Bound] = []
    for key in NUMERIC_BOUNDS:
        if key not in schema:
            continue
        value = schema[key]
        if isinstance(value, bool) and key.startswith("exclusive"):
            continue  # draft 4: read with its minimum / maximum below
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise error(f"{key!r} must be a number, got {value!r}")
        number = to_decimal(value)
        reason = check_digits(number)
        if reason is not None:
            raise error(f"{key!r} {value!r} is refused: {reason}")
        if key == "minimum":
            lows.append(Bound(number, schema.get("exclusiveMinimum") is True))
        elif key == "maximum":
            highs.append(Bound(number, schema.get("exclusiveMaximum") is True))
        else:
            (lows if key == "exclusiveMinimum" else highs).append(Bound(number, True))
    return _tightest(lows, highs)


def _tightest(lows: list[Bound], highs: list[Bound]) -> tuple[Bound | None, Bound | None]:
    """The tightest lower and upper bound (None where there is none); at the same value the exclusive one."""
    low = max(lows, key=lambda b: (b.value, b.exclusive), default=None)
    high = min(highs, key=lambda b: (b.value, not b.exclusive), default=None)
    return low, high


def _bound_number(value: Any) -> int | float:
    """A bound's value as the enforced schema writes it (JSON): an integer when it is one."""
    return int(value) if value == value.to_integral_value() else float(value)


def _bounded(schema: dict | None, low: Bound | None, high: Bound | None) -> dict | None:
    """An enforced schema with its numbers limited to the bounds: None when no value is left."""
    if schema is None:
        return None
    if list(schema) == ["anyOf"]:
        branches = [b for b in (_bounded(branch, low, high) for branch in schema["anyOf"]) if b is not None]
        if not branches:
            return None
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    keyword = "enum" if "enum" in schema else "const" if "const" in schema else None
    if keyword is not None:
        values = schema["enum"] if keyword == "enum" else [schema["const"]]
        kept = [v for v in values if not _is_number(v) or in_range(v, low, high)]
        if not kept:
            return None
        return {"enum": kept} if keyword == "enum" else {"const": kept[0]}
    if schema.get("type") not in ("integer", "number"):
        return schema  # bounds constrain numbers only
    old_low, old_high = read_bounds(schema)
    low, high = _tightest([b for b in (low, old_low) if b is not None], [b for b in (high, old_high) if b is not None])
    if bounded_regex(schema["type"] == "integer", low, high) is None:
        return None
    out: dict[str, Any] = {"type": schema["type"]}
    if low is not None:
        out["exclusiveMinimum" if low.exclusive else "minimum"] = _bound_number(low.value)
    if high is not None:
        out["exclusiveMaximum" if high.exclusive else "maximum"] = _bound_number(high.value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _has_type(value: Any, kind: str) -> bool:
    """Whether a JSON value (as Python) has JSON Schema type ``kind`` (1.0 is an integer, True is not a number)."""
    if kind == "integer":
        return _json_type(value) == "number" and float(value).is_integer()
    return _json_type(value) == kind


def enforced_schema(schema: Any, where: str, *, loosen: bool = False) -> dict:
    """``schema`` rewritten into what the grammar compiles (see the module docstring); ``where`` names it in errors.

    Raises GrammarError naming the keyword and its place for anything refused, malformed, or unsatisfiable; its
    subclass Unenforceable where the schema is well formed but our translation cannot enforce it exactly (a LOOSENED
    constraint, unless ``loosen`` drops it; a REFUSED keyword or construct)."""
    out = _Rewriter(schema, where, loosen).node(schema, "#")
    if out is None:
        raise GrammarError(
            f"{where}: no value satisfies the schema within {MAX_REF_DEPTH} levels of $ref recursion (or its "
            "numeric bounds leave no number, or it is false)"
        )
    return out

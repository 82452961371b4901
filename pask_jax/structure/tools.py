"""Tool lists: OpenAI ``tools`` -> function dicts (``parse_tools``) -> the JSON Schema of one call (``call_schema``).

A *function dict* is ``{"name": str, "description": str, "parameters": <JSON Schema of an object>}``:
``parse_tools`` makes them from an OpenAI ``tools`` list (other tool dialects translate into function dicts before
they reach the grammar). ``call_schema`` gives the schema of one call object
``{"name": <its name>, "arguments": {...}}`` with the parameters rewritten by ``schema_rewrite.enforced_schema`` into
the subset the grammar enforces (``schema``'s docstring and ``SCHEMA_KEYWORDS``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from pask_jax.structure.schema import CLOSED_EMPTY, TYPE_ALIASES, GrammarError
from pask_jax.structure.schema_rewrite import enforced_schema


def call_schema(function: dict, *, loosen: bool = False) -> dict:
    """The JSON Schema of one call object ``{"name": <its name>, "arguments": {...}}`` the grammar enforces for a
    function dict (from ``parse_tools``); descriptions do not enter it. ``loosen``: drop the constraints the grammar
    does not enforce instead of refusing them (``schema_rewrite.enforced_schema``)."""
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise GrammarError(
            "a function must be a dict with a string 'name' (OpenAI tools go through parse_tools), got "
            f"{str(function)[:120]!r}"
        )
    name = function["name"]
    arguments = enforced_schema(function.get("parameters", CLOSED_EMPTY), f"function {name!r}", loosen=loosen)
    if arguments.get("type") != "object":
        raise GrammarError(f"function {name!r}: 'parameters' must be an object schema ({{'type': 'object', ...}})")
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_tools(tools: Sequence[dict], *, check_schemas: bool = True) -> list[dict]:
    """An OpenAI ``tools`` list -> function dicts ``{"name", "description", "parameters"}`` (copies).

    Each tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`` or, for
    convenience, the bare function dict. Absent parameters mean none (``{"type": "object", "properties": {}}``);
    ``strict`` is accepted and changes nothing (the grammar always enforces the schema, as ``SCHEMA_KEYWORDS``
    says). Raises GrammarError naming the tool (its index and name) for a malformed tool, a duplicate name, or a
    schema keyword the grammar refuses or does not enforce (``check_schemas=False``: left to the grammar backend,
    ``GrammarBackend.check_tools``)."""
    if isinstance(tools, str | bytes | dict) or not isinstance(tools, Sequence):
        raise GrammarError(f"tools must be a list of tools, got {type(tools).__name__}")
    functions: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise GrammarError(f"{where}: a tool must be an object, got {type(tool).__name__}")
        function = tool
        if "type" in tool:
            if tool["type"] != "function":
                raise GrammarError(f"{where}: type {tool['type']!r} is not supported; tools are of type 'function'")
            function = tool.get("function")
            if not isinstance(function, dict):
                raise GrammarError(f"{where}: a 'function' tool needs a 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"{where}: a function needs a non-empty string 'name', got {name!r}")
        where = f"{where} ({name!r})"
        if name in seen:
            raise GrammarError(f"{where}: the name is also tools[{seen[name]}]'s; function names must be unique")
        seen[name] = i
        description = function.get("description", "")
        if not isinstance(description, str):
            raise GrammarError(f"{where}: 'description' must be a string")
        if not isinstance(function.get("strict", False), bool):
            raise GrammarError(f"{where}: 'strict' must be a boolean")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            alias = TYPE_ALIASES.get(parameters.get("type")) if isinstance(parameters, dict) else None
            hint = f" (did you mean type {alias!r}?)" if alias else ""
            raise GrammarError(
                f"{where}: 'parameters' must be a JSON Schema object ({{'type': 'object', 'properties': ...}}), "
                f"got {str(parameters)[:80]!r}{hint}"
            )
        parsed = {"name": name, "description": description, "parameters": copy.deepcopy(parameters)}
        if check_schemas:
            call_schema(parsed)  # refuses what the grammar cannot enforce now, before any compile
        functions.append(parsed)
    return functions

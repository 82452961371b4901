"""Tools in a rendered prompt: where the template wrote each tool, and the per-character roles of its definition.

``prompt_roles.label_prompt`` labels tools first (they are the most specific text), then the messages outside them;
the text search both use (``find``: outside the spans already labelled) is here. The rules for a tool:

- Each tool's JSON, as the template wrote it (any layout: ``json.dumps`` defaults, ``tojson``, ``indent=4``, sorted
  keys), lexed: the function's name TOOL_NAME; keys of a ``properties`` object PARAM_NAME; ``description`` values
  DESCRIPTION; values under ``type``, ``enum``, ``required``, ``default`` and any other schema keyword SCHEMA_VALUE;
  the keywords themselves, braces, brackets, commas, colons and whitespace SCHEMA_PUNCT (an OpenAI tool's envelope
  ``{"type": "function", "function": ...}`` likewise). Quotes belong to their string. The whitespace directly before
  each tool's JSON (the layout of the tools list) is SCHEMA_PUNCT. A template that writes tools in some other form
  (XML, Python reprs) gets a field-by-field search inside the tool's region instead: the name TOOL_NAME, parameter
  names PARAM_NAME, descriptions DESCRIPTION, each found as JSON-encoded, Python-quoted or raw text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pask_jax.models.chat_template import tool_function
from pask_jax.structure.roles import Role

WS = " \t\r\n"
# json.dumps layouts templates write tools in, tried verbatim before the general search (fast, and exact)
JSON_LAYOUTS = tuple(
    {"ensure_ascii": escape, **layout}
    for escape in (True, False)
    for layout in ({}, {"indent": 4}, {"indent": 2}, {"separators": (",", ":")})
)
_MAX_ENCLOSING_BRACES = 64  # how far out from a tool name the general search looks for the tool's opening brace
DECODER = json.JSONDecoder()
Span = tuple[int, int]


class _ToolsLexer:
    """Labels one tool's JSON text (any whitespace layout) into ``roles[offset:...]``."""

    def __init__(self, text: str, roles: np.ndarray, offset: int):
        self.text, self.roles, self.offset = text, roles, offset

    def mark(self, start: int, end: int, role: Role) -> None:
        self.roles[self.offset + start : self.offset + end] = role

    def skip_ws(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in WS:
            pos += 1
        return pos  # whitespace keeps the SCHEMA_PUNCT it was initialised with

    def string(self, pos: int, role: Role) -> tuple[int, str]:
        """A JSON string at ``pos`` (its opening quote) -> (position after it, its raw text)."""
        end = pos + 1
        while end < len(self.text) and self.text[end] != '"':
            end += 2 if self.text[end] == "\\" else 1
        self.mark(pos, end + 1, role)
        return end + 1, self.text[pos + 1 : end]

    def value(self, pos: int, context: str, role: Role) -> int:
        """Lex the value at ``pos``. context: "tool" | "function" | "schema" | "properties" | "leaf" (scalars take
        ``role``)."""
        pos = self.skip_ws(pos)
        char = self.text[pos]
        if char == "{":
            return self.obj(pos, context, role)
        if char == "[":
            pos += 1
            while True:
                pos = self.skip_ws(pos)
                if self.text[pos] == "]":
                    return pos + 1
                pos = self.value(pos, "leaf" if context in ("leaf", "schema") else context, role)
                pos = self.skip_ws(pos)
                if self.text[pos] == ",":
                    pos += 1
        if char == '"':
            return self.string(pos, role)[0]
        end = pos
        while end < len(self.text) and self.text[end] not in ",]}" + WS:
            end += 1
        self.mark(pos, end, role)
        return end

    def obj(self, pos: int, context: str, role: Role) -> int:
        pos += 1
        while True:
            pos = self.skip_ws(pos)
            if self.text[pos] == "}":
                return pos + 1
            if self.text[pos] == ",":
                pos += 1
                continue
            key_role = Role.PARAM_NAME if context == "properties" else Role.SCHEMA_PUNCT
            if context == "leaf":
                key_role = role
            pos, key = self.string(pos, key_role)
            pos = self.skip_ws(pos)
            pos += 1  # the colon
            if context == "properties":
                pos = self.value(pos, "schema", Role.SCHEMA_VALUE)
            elif context == "leaf":
                pos = self.value(pos, "leaf", role)
            elif context == "tool" and key == "function":
                pos = self.value(pos, "function", Role.SCHEMA_VALUE)
            elif key == "description":
                pos = self.value(pos, "leaf", Role.DESCRIPTION)
            elif context == "function" and key == "name":
                pos = self.value(pos, "leaf", Role.TOOL_NAME)
            elif context == "function" and key == "parameters" or context == "schema" and key == "items":
                pos = self.value(pos, "schema", Role.SCHEMA_VALUE)
            elif context == "schema" and key == "properties":
                pos = self.value(pos, "properties", Role.SCHEMA_VALUE)
            else:  # type, enum, required, default, format, ...: schema values
                pos = self.value(pos, "leaf", Role.SCHEMA_VALUE)


def overlaps(start: int, end: int, spans: Sequence[Span]) -> bool:
    return any(start < b and a < end for a, b in spans)


def find(text: str, needle: str, start: int, blocked: Sequence[Span] = ()) -> int:
    """First index >= start of ``needle`` in ``text`` not overlapping a blocked span; -1 if none."""
    pos = text.find(needle, start)
    while pos >= 0 and overlaps(pos, pos + len(needle), blocked):
        pos = text.find(needle, pos + 1)
    return pos


def _string_forms(value: str) -> Iterator[str]:
    """How a template may have written a string: JSON-encoded (either escaping), Python-quoted, raw."""
    yield from dict.fromkeys((json.dumps(value, ensure_ascii=False), json.dumps(value), repr(value), value))


def _tool_object_name(value: Any) -> tuple[str, Any] | None:
    """(lexer context, function name) if ``value`` is a tool: an OpenAI tool dict or a bare function dict."""
    if isinstance(value, dict):
        function = value.get("function")
        if value.get("type") == "function" and isinstance(function, dict):
            return "tool", function.get("name")
        if "name" in value:
            return "function", value["name"]
    return None


def _enclosing_tool(text: str, at: int, lo: int, name: str) -> tuple[int, int, str] | None:
    """The outermost JSON object in text[lo:] around index ``at`` that is a tool named ``name``: (start, end, context).

    Walks the opening braces before ``at`` outwards; each is tried as the start of a JSON value.
    """
    best, brace = None, at
    for _ in range(_MAX_ENCLOSING_BRACES):
        brace = text.rfind("{", lo, brace)
        if brace < 0:
            break
        try:
            value, end = DECODER.raw_decode(text, brace)
        except json.JSONDecodeError:
            continue
        if end <= at:
            continue  # an object that ends before the name (an earlier sibling)
        found = _tool_object_name(value)
        if found is not None and found[1] == name:
            best = (brace, end, found[0])
        elif best is not None:
            break  # the object around the tool is something else (the tools list's container)
    return best


def _locate_tool_json(text: str, tool: Mapping, function: Mapping, start: int) -> tuple[int, int, str] | None:
    """Where the template wrote this tool as JSON, at or after ``start``: (start, end, lexer context), or None."""
    forms = [(tool, "tool"), (function, "function")] if tool is not function else [(function, "function")]
    for value, context in forms:
        for layout in JSON_LAYOUTS:
            rendered = json.dumps(value, **layout)
            pos = text.find(rendered, start)
            if pos >= 0:
                return pos, pos + len(rendered), context
    for encoded in dict.fromkeys((json.dumps(function["name"], ensure_ascii=False), json.dumps(function["name"]))):
        pos = text.find(encoded, start)
        while pos >= 0:
            if (found := _enclosing_tool(text, pos, start, function["name"])) is not None:
                return found
            pos = text.find(encoded, pos + 1)
    return None


def find_word(text: str, value: str, start: int, end: int, blocked: Sequence[Span]) -> Span | None:
    """A tool's string (name, description, ...) in text[start:end] outside ``blocked``: JSON-encoded, Python-quoted,
    then as a raw word."""
    for form in _string_forms(value):
        pos = find(text, form, start, blocked)
        while form == value and 0 <= pos < end and _is_inside_word(text, pos, pos + len(form)):
            pos = find(text, form, pos + 1, blocked)  # a raw name must stand alone, not be part of a longer word
        if pos >= 0 and pos + len(form) <= end:
            return pos, pos + len(form)
    return None


def _is_inside_word(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] continues a longer identifier on either side (``get_weather`` in ``get_weather_v2``)."""

    def word(i: int) -> bool:
        return 0 <= i < len(text) and (text[i].isalnum() or text[i] in "_.")

    return word(start - 1) or word(end)


def label_tool_fields(
    text: str, roles: np.ndarray, function: Mapping, start: int, end: int, blocked: Sequence[Span]
) -> int | None:
    """Field-by-field labels for a tool written in a non-JSON form, in text[start:end] outside ``blocked``: its name,
    description, parameter names and their descriptions, in that order. The span from the name to the end of the
    last field found, or None if the name is not found."""
    name = find_word(text, function["name"], start, end, blocked)
    if name is None:
        return None
    roles[name[0] : name[1]] = Role.TOOL_NAME
    cursor = name[1]
    fields = [(function.get("description"), Role.DESCRIPTION)]
    properties = (function.get("parameters") or {}).get("properties") or {}
    for param, schema in properties.items():
        fields += [(param, Role.PARAM_NAME), ((schema or {}).get("description"), Role.DESCRIPTION)]
    for value, role in fields:
        if isinstance(value, str) and value and (span := find_word(text, value, cursor, end, blocked)) is not None:
            roles[span[0] : span[1]] = role
            cursor = span[1]
    return name[0], cursor


def tool_functions(tools: Sequence[Mapping]) -> list[Mapping]:
    functions = []
    for i, tool in enumerate(tools):
        function = tool_function(tool) if isinstance(tool, Mapping) else None
        if function is None or not isinstance(function.get("name"), str):
            raise ValueError(f"tool {i} must be an OpenAI tool or function dict with a string name, not {tool!r}")
        functions.append(function)
    return functions


def label_json_tools(
    text: str, roles: np.ndarray, tools: Sequence[Mapping], functions: Sequence[Mapping]
) -> list[Span | None]:
    """Lex each tool the template wrote as JSON, in order; returns its span per tool (None where not JSON)."""
    cursor, spans = 0, []
    for tool, function in zip(tools, functions, strict=True):
        located = _locate_tool_json(text, tool, function, cursor)
        if located is None:
            spans.append(None)
            continue
        start, end, context = located
        roles[start:end] = Role.SCHEMA_PUNCT
        _ToolsLexer(text[start:end], roles, start).value(0, context, Role.SCHEMA_VALUE)
        lead = start
        while lead > cursor and text[lead - 1] in WS:
            lead -= 1
        roles[lead:start] = Role.SCHEMA_PUNCT  # the tools list's layout before this tool
        spans.append((start, end))
        cursor = end
    return spans

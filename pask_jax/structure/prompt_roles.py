"""Roles of prompt tokens, from character offsets of the rendered prompt: for any chat template.

The caller renders ``messages`` and ``tools`` with some template (a checkpoint's own, or a fixed evaluation prompt) and
hands over the text with the same messages and tools. ``label_prompt`` finds, in that text, what the conversation put
there and labels it per character; whatever is left is the template's own (TEMPLATE):

- each message's text, located in order: a system (or developer) message SYSTEM_TEXT, the last user message
  REQUEST_TEXT (the request the answer serves), earlier user messages HISTORY_TEXT, a tool result TOOL_RESULT, an
  earlier assistant turn FREE_TEXT. A past tool call is
  also FREE_TEXT: its function name and its arguments JSON, wherever the template wrote them (the envelope around
  them, ``{"name": ``, ``"parameters": ``, ``<tool_call>``, is the template's). The generated-call roles (ARG_KEY,
  ...) are kept for what the model generates, whose roles come from the grammar's parser state. A text is looked for
  as given, stripped (templates that ``trim``), then JSON-encoded (templates that ``tojson`` a tool result); the
  whitespace a template writes directly after a message's text takes that message's role.
- each tool's JSON, as the template wrote it (any layout: ``json.dumps`` defaults, ``tojson``, ``indent=4``, sorted
  keys), lexed: the function's name TOOL_NAME; keys of a ``properties`` object PARAM_NAME; ``description`` values
  DESCRIPTION; values under ``type``, ``enum``, ``required``, ``default`` and any other schema keyword SCHEMA_VALUE;
  the keywords themselves, braces, brackets, commas, colons and whitespace SCHEMA_PUNCT (an OpenAI tool's envelope
  ``{"type": "function", "function": ...}`` likewise). Quotes belong to their string. The whitespace directly before
  each tool's JSON (the layout of the tools list) is SCHEMA_PUNCT. A template that writes tools in some other form
  (XML, Python reprs) gets a field-by-field search inside the tool's region instead: the name TOOL_NAME, parameter
  names PARAM_NAME, descriptions DESCRIPTION, each found as JSON-encoded, Python-quoted or raw text.

For a Qwen-style prompt that lists tools one JSON per line in ``<tools>`` these rules give the same labels as
lexing its ``<tools>`` block line by line and its turns by their headers. Contents are matched as text, so a message
whose whole text also occurs earlier in the template's own markup (a one-word message such as "user") can be located
there; tool JSON is matched first and never holds a message. Tools the text lists but the caller did not pass stay
TEMPLATE.

Each character inside a tool's definition (its JSON, or for other forms the region from its name to its last field
found) also carries that tool's index in the order given (``PromptLabels.tools``; NO_TOOL elsewhere), so a method
can tell the called tool's entries from the others'.

``prompt_roles`` then gives each token the role of its **first character** (tokens come with character offsets from
the ``tokenizers`` backend; a token spanning two roles, e.g. ``"}}`` closing a description and its object, is
therefore the first role: here DESCRIPTION). The first ``sink_tokens`` tokens are SINK.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pask_jax.models.chat_template import tool_call_arguments, tool_function
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.roles import NO_TOOL, Role

_CONTENT_ROLE = {
    "system": Role.SYSTEM_TEXT,
    "developer": Role.SYSTEM_TEXT,
    "user": Role.HISTORY_TEXT,  # the last user message: REQUEST_TEXT (`_content_roles`)
    "assistant": Role.FREE_TEXT,
    "tool": Role.TOOL_RESULT,
    "ipython": Role.TOOL_RESULT,  # Llama 3's name for a tool result
}
_WS = " \t\r\n"
# json.dumps layouts templates write tools in, tried verbatim before the general search (fast, and exact)
_JSON_LAYOUTS = tuple(
    {"ensure_ascii": escape, **layout}
    for escape in (True, False)
    for layout in ({}, {"indent": 4}, {"indent": 2}, {"separators": (",", ":")})
)
_MAX_ENCLOSING_BRACES = 64  # how far out from a tool name the general search looks for the tool's opening brace
_DECODER = json.JSONDecoder()
Span = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class PromptLabels:
    """Per-character roles of a rendered prompt and the tools located in it."""

    roles: np.ndarray  # i32[len(text)]
    tool_names: list[str]  # the function names of the tools, in the order given (each one located)
    tools: np.ndarray  # i32[len(text)] the index of the tool whose definition holds the character, NO_TOOL if none


@dataclasses.dataclass(frozen=True)
class TokenLabels:
    """Per-token labels of a prompt: the role of each token and the tool each describes."""

    roles: list[int]
    tools: list[int]  # index into ``tool_names`` (NO_TOOL: none)
    tool_names: list[str]

    def tools_for(self, function_names: Sequence[str]) -> list[int]:
        """``tools`` renumbered by ``function_names`` (a grammar's callable tools): a listed tool not among them
        gets ``len(function_names)``, an index no call has."""
        index = {name: function_names.index(name) if name in function_names else len(function_names)
                 for name in self.tool_names}  # fmt: skip
        return [NO_TOOL if t == NO_TOOL else index[self.tool_names[t]] for t in self.tools]


class _ToolsLexer:
    """Labels one tool's JSON text (any whitespace layout) into ``roles[offset:...]``."""

    def __init__(self, text: str, roles: np.ndarray, offset: int):
        self.text, self.roles, self.offset = text, roles, offset

    def mark(self, start: int, end: int, role: Role) -> None:
        self.roles[self.offset + start : self.offset + end] = role

    def skip_ws(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in _WS:
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
        while end < len(self.text) and self.text[end] not in ",]}" + _WS:
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


def _overlaps(start: int, end: int, spans: Sequence[Span]) -> bool:
    return any(start < b and a < end for a, b in spans)


def _find(text: str, needle: str, start: int, blocked: Sequence[Span] = ()) -> int:
    """First index >= start of ``needle`` in ``text`` not overlapping a blocked span; -1 if none."""
    pos = text.find(needle, start)
    while pos >= 0 and _overlaps(pos, pos + len(needle), blocked):
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
            value, end = _DECODER.raw_decode(text, brace)
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
        for layout in _JSON_LAYOUTS:
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


def _find_word(text: str, value: str, start: int, end: int, blocked: Sequence[Span]) -> Span | None:
    """A tool's string (name, description, ...) in text[start:end] outside ``blocked``: JSON-encoded, Python-quoted,
    then as a raw word."""
    for form in _string_forms(value):
        pos = _find(text, form, start, blocked)
        while form == value and 0 <= pos < end and _is_inside_word(text, pos, pos + len(form)):
            pos = _find(text, form, pos + 1, blocked)  # a raw name must stand alone, not be part of a longer word
        if pos >= 0 and pos + len(form) <= end:
            return pos, pos + len(form)
    return None


def _is_inside_word(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] continues a longer identifier on either side (``get_weather`` in ``get_weather_v2``)."""

    def word(i: int) -> bool:
        return 0 <= i < len(text) and (text[i].isalnum() or text[i] in "_.")

    return word(start - 1) or word(end)


def _label_tool_fields(
    text: str, roles: np.ndarray, function: Mapping, start: int, end: int, blocked: Sequence[Span]
) -> int | None:
    """Field-by-field labels for a tool written in a non-JSON form, in text[start:end] outside ``blocked``: its name,
    description, parameter names and their descriptions, in that order. The span from the name to the end of the
    last field found, or None if the name is not found."""
    name = _find_word(text, function["name"], start, end, blocked)
    if name is None:
        return None
    roles[name[0] : name[1]] = Role.TOOL_NAME
    cursor = name[1]
    fields = [(function.get("description"), Role.DESCRIPTION)]
    properties = (function.get("parameters") or {}).get("properties") or {}
    for param, schema in properties.items():
        fields += [(param, Role.PARAM_NAME), ((schema or {}).get("description"), Role.DESCRIPTION)]
    for value, role in fields:
        if isinstance(value, str) and value and (span := _find_word(text, value, cursor, end, blocked)) is not None:
            roles[span[0] : span[1]] = role
            cursor = span[1]
    return name[0], cursor


def _tool_functions(tools: Sequence[Mapping]) -> list[Mapping]:
    functions = []
    for i, tool in enumerate(tools):
        function = tool_function(tool) if isinstance(tool, Mapping) else None
        if function is None or not isinstance(function.get("name"), str):
            raise ValueError(f"tool {i} must be an OpenAI tool or function dict with a string name, not {tool!r}")
        functions.append(function)
    return functions


def _label_json_tools(
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
        while lead > cursor and text[lead - 1] in _WS:
            lead -= 1
        roles[lead:start] = Role.SCHEMA_PUNCT  # the tools list's layout before this tool
        spans.append((start, end))
        cursor = end
    return spans


def _message_pieces(index: int, message: Mapping) -> list[str | dict]:
    """What a message puts in the prompt, in order: its texts, then each tool call's name and arguments (a dict)."""
    content = message.get("content")
    if isinstance(content, str):
        pieces: list[str | dict] = [content]
    elif isinstance(content, list):  # OpenAI content parts: only text parts reach a text prompt
        pieces = [part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text"]
    elif content is None:
        pieces = []
    else:
        raise ValueError(f"message {index}: content must be a string, a list of parts or None, not {content!r}")
    for k, call in enumerate(message.get("tool_calls") or []):
        target = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(target, Mapping) or not isinstance(target.get("name"), str):
            raise ValueError(f"message {index}: tool call {k} has no function name: {call!r}")
        pieces.append(target["name"])
        if "arguments" in target:
            pieces.append(tool_call_arguments(target["arguments"]))
    return [piece for piece in pieces if not isinstance(piece, str) or piece.strip()]


def _locate_json_value(text: str, value: dict, start: int, blocked: Sequence[Span]) -> Span | None:
    """The first JSON text at or after ``start`` (outside ``blocked``) that decodes to ``value``."""
    for layout in _JSON_LAYOUTS:
        rendered = json.dumps(value, **layout)
        if (pos := _find(text, rendered, start, blocked)) >= 0:
            return pos, pos + len(rendered)
    pos = _find(text, "{", start, blocked)
    while pos >= 0:
        try:
            decoded, end = _DECODER.raw_decode(text, pos)
            if decoded == value and not _overlaps(pos, end, blocked):
                return pos, end
        except json.JSONDecodeError:
            pass
        pos = _find(text, "{", pos + 1, blocked)
    return None


def _locate_text(text: str, piece: str, start: int, blocked: Sequence[Span]) -> Span | None:
    """A message text at or after ``start``: as given, stripped, then JSON-encoded."""
    for form in dict.fromkeys((piece, piece.strip(), json.dumps(piece, ensure_ascii=False), json.dumps(piece))):
        if (pos := _find(text, form, start, blocked)) >= 0:
            return pos, pos + len(form)
    return None


def _content_roles(messages: Sequence[Mapping]) -> list[Role]:
    """The role of each message's text: by its author, the last user message REQUEST_TEXT."""
    kinds = [message.get("role") if isinstance(message, Mapping) else None for message in messages]
    for index, kind in enumerate(kinds):
        if kind not in _CONTENT_ROLE:
            raise ValueError(f"message {index}: role {kind!r} is not one of {sorted(_CONTENT_ROLE)}")
    roles = [_CONTENT_ROLE[kind] for kind in kinds]
    if "user" in kinds:
        roles[len(kinds) - 1 - kinds[::-1].index("user")] = Role.REQUEST_TEXT
    return roles


def _label_messages(text: str, roles: np.ndarray, messages: Sequence[Mapping], blocked: Sequence[Span]) -> list[Span]:
    """Label each message's pieces, located in order outside ``blocked``; returns the spans labelled."""
    cursor, spans = 0, []
    for index, (message, role) in enumerate(zip(messages, _content_roles(messages), strict=True)):
        kind = message["role"]
        for piece in _message_pieces(index, message):
            if isinstance(piece, dict):
                span = _locate_json_value(text, piece, cursor, blocked)
            else:
                span = _locate_text(text, piece, cursor, blocked)
            if span is None:
                raise ValueError(
                    f"message {index} ({kind}): {piece!r} is not in the rendered prompt after position {cursor} "
                    "(the template rewrites it, or these are not the messages rendered)"
                )
            start, end = span
            while end < len(text) and text[end] in _WS and not _overlaps(end, end + 1, blocked):
                end += 1  # the whitespace the template writes right after a text belongs to it
            roles[start:end] = role
            spans.append((start, end))
            cursor = end
    return spans


def label_prompt(
    text: str, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> PromptLabels:
    """Per-character roles of ``text``, a rendering of ``messages`` and ``tools`` (OpenAI tool dicts or bare
    function dicts, as rendered) by any chat template.

    Tools written as JSON are found first (they are the most specific text), then the messages outside them, then
    the tools written in other forms, outside both. ValueError names the message or tool that cannot be found.
    """
    tools = list(tools or [])
    functions = _tool_functions(tools)
    roles = np.full(len(text), int(Role.TEMPLATE), np.int32)
    tool_roles = roles.copy()  # painted over the message roles at the end: a tool's leading whitespace is its own
    json_spans = _label_json_tools(text, tool_roles, tools, functions)
    blocked = [span for span in json_spans if span is not None]
    blocked += _label_messages(text, roles, messages, blocked)
    tool_ids = np.full(len(text), NO_TOOL, np.int32)
    cursor = 0
    for i, (function, span) in enumerate(zip(functions, json_spans, strict=True)):
        if span is not None:
            tool_ids[span[0] : span[1]] = i
            cursor = span[1]
            continue
        following = [s[0] for s in json_spans[i + 1 :] if s is not None]  # the next JSON tool bounds the search
        end = following[0] if following else len(text)
        if i + 1 < len(functions) and json_spans[i + 1] is None:
            later = _find_word(text, functions[i + 1]["name"], cursor, end, blocked)
            end = later[0] if later is not None else end
        found = _label_tool_fields(text, tool_roles, function, cursor, end, blocked)
        if found is None:
            raise ValueError(f"tool {i} ({function['name']!r}) is not in the rendered prompt")
        tool_ids[found[0] : found[1]] = i
        cursor = found[1]
    painted = tool_roles != Role.TEMPLATE
    roles[painted] = tool_roles[painted]
    return PromptLabels(roles=roles, tool_names=[f["name"] for f in functions], tools=tool_ids)


def token_labels(
    text: str,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    sink_tokens: int = 1,
) -> TokenLabels:
    """Each token of ``tokenizer.encode(text)`` labelled by its first character (``label_prompt``): its role (the
    first ``sink_tokens`` tokens SINK) and the tool it describes."""
    labels = label_prompt(text, messages, tools)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    firsts = [start for start, _ in encoding.offsets]
    roles = [int(labels.roles[s]) if s < len(text) else int(Role.TEMPLATE) for s in firsts]
    for i in range(min(sink_tokens, len(roles))):
        roles[i] = int(Role.SINK)
    tool_ids = [int(labels.tools[s]) if s < len(text) else NO_TOOL for s in firsts]
    return TokenLabels(roles=roles, tools=tool_ids, tool_names=labels.tool_names)


def prompt_roles(
    text: str,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    sink_tokens: int = 1,
) -> list[int]:
    """Role of each token of ``tokenizer.encode(text)`` (``token_labels``)."""
    return token_labels(text, tokenizer, messages, tools, sink_tokens=sink_tokens).roles

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
- each tool, as the template wrote it (JSON in any layout, lexed, or another form, searched field by field): its
  name TOOL_NAME, parameter names PARAM_NAME, descriptions DESCRIPTION, the rest of its JSON SCHEMA_VALUE /
  SCHEMA_PUNCT (the rules are in ``prompt_tools``).

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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pask_jax.models.chat_template import tool_call_arguments
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.prompt_tools import (
    DECODER,
    JSON_LAYOUTS,
    WS,
    Span,
    find,
    find_word,
    label_json_tools,
    label_tool_fields,
    overlaps,
    tool_functions,
)
from pask_jax.structure.roles import NO_TOOL, Role

_CONTENT_ROLE = {
    "system": Role.SYSTEM_TEXT,
    "developer": Role.SYSTEM_TEXT,
    "user": Role.HISTORY_TEXT,  # the last user message: REQUEST_TEXT (`_content_roles`)
    "assistant": Role.FREE_TEXT,
    "tool": Role.TOOL_RESULT,
    "ipython": Role.TOOL_RESULT,  # Llama 3's name for a tool result
}


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
    for layout in JSON_LAYOUTS:
        rendered = json.dumps(value, **layout)
        if (pos := find(text, rendered, start, blocked)) >= 0:
            return pos, pos + len(rendered)
    pos = find(text, "{", start, blocked)
    while pos >= 0:
        try:
            decoded, end = DECODER.raw_decode(text, pos)
            if decoded == value and not overlaps(pos, end, blocked):
                return pos, end
        except json.JSONDecodeError:
            pass
        pos = find(text, "{", pos + 1, blocked)
    return None


def _locate_text(text: str, piece: str, start: int, blocked: Sequence[Span]) -> Span | None:
    """A message text at or after ``start``: as given, stripped, then JSON-encoded."""
    for form in dict.fromkeys((piece, piece.strip(), json.dumps(piece, ensure_ascii=False), json.dumps(piece))):
        if (pos := find(text, form, start, blocked)) >= 0:
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
            while end < len(text) and text[end] in WS and not overlaps(end, end + 1, blocked):
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
    functions = tool_functions(tools)
    roles = np.full(len(text), int(Role.TEMPLATE), np.int32)
    tool_roles = roles.copy()  # painted over the message roles at the end: a tool's leading whitespace is its own
    json_spans = label_json_tools(text, tool_roles, tools, functions)
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
            later = find_word(text, functions[i + 1]["name"], cursor, end, blocked)
            end = later[0] if later is not None else end
        found = label_tool_fields(text, tool_roles, function, cursor, end, blocked)
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

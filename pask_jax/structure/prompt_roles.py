"""Roles of prompt tokens: chat template, system text, the tools JSON (lexed), user text.

The prompt is labelled per character, then each token takes the role of its **first character** (tokens come with
character offsets from the ``tokenizers`` backend; a token spanning two roles, e.g. ``"}}`` closing a description and
its object, is therefore the first role: here DESCRIPTION). Character roles:

- ``<|im_start|>role\\n`` headers, ``<|im_end|>`` and the text between turns: TEMPLATE;
- a system message's own text: SYSTEM_TEXT; a user message: USER_TEXT; an earlier assistant turn: FREE_TEXT;
  a tool-response turn: USER_TEXT (external input, like the user's);
- the tools block's fixed header and footer (``# Tools ... <tools>``, ``</tools> ... </tool_call>``): TEMPLATE;
- each tool's JSON between ``<tools>`` and ``</tools>``, lexed as JSON: the function's name value TOOL_NAME; keys of
  a ``properties`` object PARAM_NAME; ``description`` values DESCRIPTION; values under ``type``, ``enum``,
  ``required``, ``default`` and any other schema keyword SCHEMA_VALUE; the keywords themselves, braces, brackets,
  commas, colons and whitespace SCHEMA_PUNCT. Quotes belong to their string.

The first ``sink_tokens`` tokens (default 1: ``<|im_start|>``) are SINK. Works on any text that
``pask_jax.models.chat_template.format_tool_prompt`` writes (BFCL's Qwen FC prompt); text outside a recognised turn
is TEMPLATE.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pask_jax.models.chat_template import TOOLS_FOOTER, TOOLS_HEADER
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.roles import Role

_TURN = re.compile(r"<\|im_start\|>([a-z_]*)\n(.*?)(?=<\|im_end\|>|<\|im_start\|>|\Z)", re.DOTALL)
_CONTENT_ROLE = {
    "system": Role.SYSTEM_TEXT,
    "user": Role.USER_TEXT,
    "assistant": Role.FREE_TEXT,
    "tool": Role.USER_TEXT,
}
_WS = " \t\r\n"


class _ToolsLexer:
    """Labels one tool's JSON text (as ``json.dumps`` writes it) into ``roles[offset:...]``."""

    def __init__(self, text: str, roles: np.ndarray, offset: int):
        self.text, self.roles, self.offset = text, roles, offset
        self.names: list[str] = []

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
        """Lex the value at ``pos``. context: "function" | "schema" | "properties" | "leaf" (scalars take ``role``)."""
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
            elif key == "description":
                pos = self.value(pos, "leaf", Role.DESCRIPTION)
            elif context == "function" and key == "name":
                start = self.skip_ws(pos)
                pos = self.value(pos, "leaf", Role.TOOL_NAME)
                self.names.append(self.text[start + 1 : pos - 1])
            elif context == "function" and key == "parameters" or context == "schema" and key == "items":
                pos = self.value(pos, "schema", Role.SCHEMA_VALUE)
            elif context == "schema" and key == "properties":
                pos = self.value(pos, "properties", Role.SCHEMA_VALUE)
            else:  # type, enum, required, default, format, ...: schema values
                pos = self.value(pos, "leaf", Role.SCHEMA_VALUE)


def _label_tools(text: str, roles: np.ndarray, start: int, end: int) -> list[str]:
    """Label the tools JSON region text[start:end] (one JSON object per line); returns the function names."""
    roles[start:end] = Role.SCHEMA_PUNCT
    lexer = _ToolsLexer(text[start:end], roles, start)
    pos = lexer.skip_ws(0)
    while pos < len(lexer.text):
        pos = lexer.skip_ws(lexer.value(pos, "function", Role.SCHEMA_VALUE))
    return lexer.names


def char_roles(prompt_text: str) -> tuple[np.ndarray, list[str]]:
    """i32[len(prompt_text)] role per character, and the function names found in the tools JSON."""
    roles = np.full(len(prompt_text), int(Role.TEMPLATE), np.int32)
    names: list[str] = []
    for turn in _TURN.finditer(prompt_text):
        kind, start, end = turn.group(1), turn.start(2), turn.end(2)
        content_role = _CONTENT_ROLE.get(kind, Role.TEMPLATE)
        header = prompt_text.find(TOOLS_HEADER, start, end) if kind == "system" else -1
        if header < 0:
            roles[start:end] = content_role
            continue
        roles[start:header] = content_role  # the system message folded in before the tools block
        tools_start = header + len(TOOLS_HEADER)
        footer = prompt_text.find(TOOLS_FOOTER, tools_start)  # "\n</tools>\n\nFor each function call, ..."
        if footer < 0:
            raise ValueError("the prompt has the tools header but not the template's footer after the tools JSON")
        try:
            names += _label_tools(prompt_text, roles, tools_start, footer)
        except (IndexError, ValueError) as exc:
            raise ValueError(f"the tools JSON between <tools> and </tools> does not lex as JSON: {exc}") from exc
    return roles, names


def prompt_roles(
    prompt_text: str, tokenizer: Tokenizer, functions: Sequence[dict] | None = None, *, sink_tokens: int = 1
) -> list[int]:
    """Role of each token of ``tokenizer.encode(prompt_text)``: the role of the token's first character.

    ``functions``, if given, must be the tools the prompt lists (their names are checked against the tools JSON).
    """
    roles, names = char_roles(prompt_text)
    if functions is not None and names != [f["name"] for f in functions]:
        raise ValueError(
            f"the prompt's tools JSON lists {names}, not the given functions {[f['name'] for f in functions]}"
        )
    encoding = tokenizer.backend.encode(prompt_text, add_special_tokens=False)
    out = [int(roles[start]) if start < len(roles) else int(Role.TEMPLATE) for start, _ in encoding.offsets]
    for i in range(min(sink_tokens, len(out))):
        out[i] = int(Role.SINK)
    return out

"""The token-role taxonomy: one small integer per token, in one place, with stable ids.

A role says what a token *is* in a structured-generation request: a prompt token is chat-template markup, system
text, part of the tools JSON (a function name, a parameter name, a type / enum value / required list, a description,
schema punctuation) or user text; a generated token is part of a tool call (structural boundary, framing, function
name, argument key, argument value string / number / literal, whitespace), free text, or the end of the turn. SINK
marks attention-sink positions (the first prompt token). The persistence policy is a table over (role, layer group)
buckets, so these ids are part of every compiled policy: **never renumber a role**. Add new roles at the end and bump
``TAXONOMY_VERSION``; a policy records the version it was calibrated with.

Role 0 (``TEMPLATE``) is what a zero-filled role array means (the engine pads with zeros).
"""

from __future__ import annotations

from enum import IntEnum

TAXONOMY_VERSION = "pask-roles-v1"


class Role(IntEnum):
    # ---- prompt roles ----
    TEMPLATE = 0  # chat-template markup and special tokens: <|im_start|>, "system\n", the tools header/footer text
    SYSTEM_TEXT = 1  # a system message's own text
    TOOL_NAME = 2  # a function's name in the tools JSON
    PARAM_NAME = 3  # a parameter name (a key of a "properties" object) in the tools JSON
    SCHEMA_VALUE = 4  # type names, enum values, the required list, defaults and other schema values
    DESCRIPTION = 5  # description strings in the tools JSON
    SCHEMA_PUNCT = 6  # JSON punctuation, whitespace and schema keywords ("type", "properties", ...) of the tools JSON
    USER_TEXT = 7  # a user message's text
    # ---- generated roles (from the grammar's parser state) ----
    STRUCTURAL = 8  # braces, brackets, commas, colons of a call; the envelope keys "name" / "arguments"
    FRAMING = 9  # <tool_call>, </tool_call>, code fences, the newlines around and between calls
    FUNCTION_NAME = 10  # the called function's name (the value of "name"), quotes included
    ARG_KEY = 11  # an argument key (also keys of nested objects), quotes included
    ARG_STRING = 12  # a string argument value, quotes included
    ARG_NUMBER = 13  # a number argument value
    ARG_LITERAL = 14  # true / false / null
    WHITESPACE = 15  # whitespace inside a call's JSON
    FREE_TEXT = 16  # generated text outside any grammar
    END_OF_TURN = 17  # <|im_end|> / EOS
    # ---- either ----
    SINK = 18  # attention-sink position(s)


PROMPT_ROLES: tuple[Role, ...] = (
    Role.TEMPLATE,
    Role.SYSTEM_TEXT,
    Role.TOOL_NAME,
    Role.PARAM_NAME,
    Role.SCHEMA_VALUE,
    Role.DESCRIPTION,
    Role.SCHEMA_PUNCT,
    Role.USER_TEXT,
)
GENERATED_ROLES: tuple[Role, ...] = (
    Role.STRUCTURAL,
    Role.FRAMING,
    Role.FUNCTION_NAME,
    Role.ARG_KEY,
    Role.ARG_STRING,
    Role.ARG_NUMBER,
    Role.ARG_LITERAL,
    Role.WHITESPACE,
    Role.FREE_TEXT,
    Role.END_OF_TURN,
)


def num_roles() -> int:
    """Number of role ids (ids are 0..num_roles()-1): the first dimension of a persistence policy table."""
    return len(Role)


def role_names() -> list[str]:
    """Role names in id order (for policy summaries and plots)."""
    return [r.name for r in sorted(Role)]

"""The token-role taxonomy: one small integer per token, in one place, with stable ids.

A role says what a token *is* in a structured-generation request: a prompt token is chat-template markup, system
text, part of the tools JSON (a function name, a parameter name, a type / enum value / required list, a description,
schema punctuation), the request the answer serves (the last user turn; ``REQUEST_TEXT``), earlier user turns or a
tool's result; a generated token is part of a tool call (structural boundary, framing, function
name, argument key, argument value string / number / literal, whitespace), free text, or the end of the turn. SINK
marks attention-sink positions (the first prompt token). The persistence policy is a table over (role, layer group)
buckets, so these ids are part of every compiled policy: **never renumber a role**. Add new roles at the end and bump
``TAXONOMY_VERSION``; a policy records the version it was calibrated with, and a policy of an older taxonomy answers
the roles added since with a stand-in role's column (``ROLE_UPGRADES``).

Role 0 (``TEMPLATE``) is what a zero-filled role array means (the engine pads with zeros).
"""

from __future__ import annotations

from enum import IntEnum

TAXONOMY_VERSION = "pask-roles-v2"


class Role(IntEnum):
    # ---- prompt roles ----
    TEMPLATE = 0  # chat-template markup and special tokens: <|im_start|>, "system\n", the tools header/footer text
    SYSTEM_TEXT = 1  # a system message's own text
    TOOL_NAME = 2  # a function's name in the tools JSON
    PARAM_NAME = 3  # a parameter name (a key of a "properties" object) in the tools JSON
    SCHEMA_VALUE = 4  # type names, enum values, the required list, defaults and other schema values
    DESCRIPTION = 5  # description strings in the tools JSON
    SCHEMA_PUNCT = 6  # JSON punctuation, whitespace and schema keywords ("type", "properties", ...) of the tools JSON
    USER_TEXT = 7  # a user message's text (pask-roles-v1; v2 labels REQUEST_TEXT / HISTORY_TEXT / TOOL_RESULT)
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
    # ---- prompt roles added by pask-roles-v2: where the request sits ----
    REQUEST_TEXT = 19  # the last user message's text: the request the answer must serve
    HISTORY_TEXT = 20  # earlier user messages' text
    TOOL_RESULT = 21  # a tool message's text (a function's result fed back)


PROMPT_ROLES: tuple[Role, ...] = (
    Role.TEMPLATE,
    Role.SYSTEM_TEXT,
    Role.TOOL_NAME,
    Role.PARAM_NAME,
    Role.SCHEMA_VALUE,
    Role.DESCRIPTION,
    Role.SCHEMA_PUNCT,
    Role.USER_TEXT,
    Role.REQUEST_TEXT,
    Role.HISTORY_TEXT,
    Role.TOOL_RESULT,
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


NO_TOOL = -1  # beside the roles: a prompt token that describes no offered tool, or a call whose function is not known


def num_roles() -> int:
    """Number of role ids (ids are 0..num_roles()-1): the first dimension of a persistence policy table."""
    return len(Role)


def role_names() -> list[str]:
    """Role names in id order (for policy summaries and plots)."""
    return [r.name for r in sorted(Role)]


# Older taxonomies a policy may carry, each with its role count and, for every role added since, the old role whose
# calibrated column stands in for it: in v1 every user-authored text (the request, history, tool results) was
# USER_TEXT, so a v1 policy answers the v2 roles with its USER_TEXT floor, priority and action.
ROLE_UPGRADES: dict[str, tuple[int, dict[Role, Role]]] = {
    "pask-roles-v1": (
        19,
        {Role.REQUEST_TEXT: Role.USER_TEXT, Role.HISTORY_TEXT: Role.USER_TEXT, Role.TOOL_RESULT: Role.USER_TEXT},
    ),
}


def taxonomy_roles(taxonomy: str) -> int:
    """Number of role ids of `taxonomy` (the current one or one in ``ROLE_UPGRADES``); ValueError for others."""
    if taxonomy == TAXONOMY_VERSION:
        return num_roles()
    if taxonomy in ROLE_UPGRADES:
        return ROLE_UPGRADES[taxonomy][0]
    raise ValueError(f"role taxonomy {taxonomy!r} is unknown: this version reads {[TAXONOMY_VERSION, *ROLE_UPGRADES]}")


def upgrade_rows(rows, taxonomy: str):
    """A table indexed by `taxonomy`'s role ids along axis 0 (numpy array) -> the same table over the current ids:
    each role added since takes the row of the role standing in for it (``ROLE_UPGRADES``)."""
    if taxonomy == TAXONOMY_VERSION:
        return rows
    count, stand_ins = ROLE_UPGRADES[taxonomy]
    if rows.shape[0] != count:
        raise ValueError(f"a {taxonomy} table has {count} role rows, not {rows.shape[0]}")
    source = list(range(count)) + [int(stand_ins[Role(r)]) for r in range(count, num_roles())]
    return rows[source]

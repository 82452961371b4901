"""A small byte-level JSON lexer: the role of every byte of a generated assistant turn.

The generated side uses it: the grammar's role walk (``grammar.py``) runs it over the witness bytes of each DFA
state, incrementally (a state's lexer state is its parent's fed with one token's bytes), so its states are immutable
named values that children share. The prompt labeller (``prompt_roles``) works differently because it labels known
spans of the rendered chat template, located by character offsets (a tool's JSON, a message's text) and classified
whole, not a byte stream resumed edge by edge through a DFA, so it has no use for resumable lexer states.

Roles: quotes belong to their string; the call envelope's keys ``"name"`` / ``"arguments"`` and all braces,
brackets, commas and colons are STRUCTURAL; the value of ``"name"`` is FUNCTION_NAME; keys inside the arguments (and
inside a ``response_format`` value) are ARG_KEY, values ARG_STRING / ARG_NUMBER / ARG_LITERAL; whitespace inside the
JSON is WHITESPACE; bytes outside the JSON (markers, fences, newlines around and between calls) are FRAMING; a text
answer (``tool_choice="auto"``) is FREE_TEXT; the end-of-turn marker is END_OF_TURN. ``LEX_PROSE`` reads a text
answer that may hold a call the model wrote as text (a fence, bare JSON): its prose is FREE_TEXT, and a JSON value
in it is lexed as a call, so the call's tokens get the call's roles.
"""

from __future__ import annotations

from typing import NamedTuple

from pask_jax.structure.roles import Role
from pask_jax.structure.vocabulary import CALL_OPEN, END_OF_TURN


class Frame(NamedTuple):
    """One open JSON container."""

    kind: str  # "call" (a call object) | "args" (its arguments) | "obj" | "arr" | "calls" (a list of calls) | "root"
    expect: str  # objects: "key" | "value"
    key: str | None  # the call object's current key ("name" / "arguments"; call frames only)


class StringLex(NamedTuple):
    """Inside a string."""

    role: int
    is_key: bool
    escaped: bool  # the last byte was a backslash
    text: bytes | None  # the key's bytes so far (call-object keys only)


class LexState(NamedTuple):
    stack: tuple[Frame, ...] = ()
    string: StringLex | None = None
    scalar: int | None = None  # the role of the number or literal being read
    # bytes outside any JSON value: "framing" | "undecided" (auto: call or text?) | "text" | "prose" (text that may
    # hold a call written as JSON)
    outside: str = "framing"


LEX_CALLS = LexState()  # tool calls: outside the JSON is framing
# tool_choice="auto": a first byte <tool_call>, { or ` starts a call (as the grammar has it), any other a text answer
LEX_AUTO = LexState(outside="undecided")
LEX_JSON = LexState(stack=(Frame("root", "value", None),))  # response_format: the turn is one JSON value
LEX_PROSE = LexState(outside="prose")  # a text answer: prose, and any JSON value in it read as a call
_WS = frozenset(b" \t\r\n")
_CALL_STARTS = frozenset((CALL_OPEN[0], 0x7B, 0x60))  # <tool_call>, {, `
_NUMBER_START = frozenset(b"-0123456789")
_SCALAR_BYTES = frozenset(b"0123456789+-.eEtruefalsn")
_OBJECTS = ("call", "args", "obj")


def lex_step(state: LexState, byte: int) -> tuple[LexState, int]:
    """Feed one byte: -> (new state, role of that byte)."""
    # States are built with the constructors, not ``_replace``: the role walk lexes every byte of ~10^5 tokens.
    stack, string, scalar, outside = state
    if string is not None:
        role, is_key, escaped, text = string
        if escaped:
            return LexState(stack, StringLex(role, is_key, False, text), None, outside), role
        if byte == 0x5C:  # backslash
            return LexState(stack, StringLex(role, is_key, True, text), None, outside), role
        if byte == 0x22:  # closing quote
            if is_key:
                kind, _, key = stack[-1]
                key = text.decode("utf-8", "replace") if kind == "call" else key
                stack = (*stack[:-1], Frame(kind, "value", key))
            return LexState(stack, None, None, outside), role
        text = text + bytes([byte]) if text is not None else None
        return LexState(stack, StringLex(role, is_key, False, text), None, outside), role
    if scalar is not None and byte in _SCALAR_BYTES:
        return state, scalar
    if byte == END_OF_TURN[0]:
        return LexState(stack, None, None, outside), Role.END_OF_TURN
    if not stack:
        if outside == "text" or (outside == "undecided" and byte not in _CALL_STARTS):
            return LexState(stack, None, None, "text"), Role.FREE_TEXT
        if outside == "prose" and byte not in (0x7B, 0x5B):
            return state, Role.FREE_TEXT
        after = "prose" if outside == "prose" else "framing"
        if byte == 0x7B:  # {
            return LexState((Frame("call", "key", None),), None, None, after), Role.STRUCTURAL
        if byte == 0x5B:  # [
            return LexState((Frame("calls", "value", None),), None, None, after), Role.STRUCTURAL
        return LexState(stack, None, None, "framing"), Role.FRAMING
    kind, expect, key = stack[-1]
    if byte in _WS:
        return LexState(stack, None, None, outside), Role.WHITESPACE
    if byte == 0x7B:
        child = "call" if kind == "calls" else "args" if kind == "call" and key == "arguments" else "obj"
        return LexState((*stack, Frame(child, "key", None)), None, None, outside), Role.STRUCTURAL
    if byte == 0x5B:
        return LexState((*stack, Frame("arr", "value", None)), None, None, outside), Role.STRUCTURAL
    if byte in (0x7D, 0x5D):  # } ]
        return LexState(stack[:-1], None, None, outside), Role.STRUCTURAL
    if byte == 0x2C:  # ,
        if kind in _OBJECTS:
            stack = (*stack[:-1], Frame(kind, "key", key))
        return LexState(stack, None, None, outside), Role.STRUCTURAL
    if byte == 0x3A:  # :
        return LexState(stack, None, None, outside), Role.STRUCTURAL
    if byte == 0x22:  # opening quote
        if kind in _OBJECTS and expect == "key":
            role = Role.STRUCTURAL if kind == "call" else Role.ARG_KEY
            return LexState(stack, StringLex(role, True, False, b"" if kind == "call" else None), None, outside), role
        role = Role.FUNCTION_NAME if kind == "call" and key == "name" else Role.ARG_STRING
        return LexState(stack, StringLex(role, False, False, None), None, outside), role
    if byte in _NUMBER_START:
        return LexState(stack, None, Role.ARG_NUMBER, outside), Role.ARG_NUMBER
    if byte in b"tfn":
        return LexState(stack, None, Role.ARG_LITERAL, outside), Role.ARG_LITERAL
    return LexState(stack, None, None, outside), Role.FREE_TEXT


def lex_roles(text: bytes, state: LexState = LEX_CALLS) -> list[int]:
    """The role of every byte of ``text`` (framing symbols as marker bytes)."""
    roles = []
    for byte in text:
        state, role = lex_step(state, byte)
        roles.append(int(role))
    return roles


_MINOR_ROLES = (Role.WHITESPACE, Role.FRAMING)


def lex_token(state: LexState, raw: bytes) -> tuple[LexState, int, int]:
    """Feed one token's bytes: -> (new state, the token's role, the role of its last byte).

    The token's role is that of its last byte, skipping trailing whitespace / framing bytes when it has others:
    Qwen writes a call's end as the single token ``}}\\n``, which is STRUCTURAL, not FRAMING.
    """
    token_role = last = None
    for byte in raw:
        state, last = lex_step(state, byte)
        if last not in _MINOR_ROLES or token_role is None or token_role in _MINOR_ROLES:
            token_role = last
    if last is None:
        raise ValueError("a token has at least one byte")
    return state, int(token_role), int(last)

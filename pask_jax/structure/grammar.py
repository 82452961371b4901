"""The tool-call grammar: BFCL function dicts -> JSON Schema -> regex -> outlines-core index, with token roles.

What the model may write (``framing="tool_call"``, Qwen's own format), then the end of turn (``<|im_end|>``)::

    <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>

with ``parallel=True`` one or more such blocks separated by ``\n``. ``framing="json_fence"`` is what
Qwen2.5-Coder writes unconstrained: a Markdown ``json`` fence around the same call object, often pretty-printed (so
there the whitespace pattern also allows a newline plus indentation); with ``parallel=True`` the fence holds one or
more calls as JSON lines (one call object after another, separated by ``\n``), which is how that model writes
several calls when it does.

Inside a call the JSON is tight: the whitespace pattern is ``[ ]?`` (at most one space wherever JSON allows
whitespace), so ``json.dumps``'s ``", "`` / ``": "`` separators are accepted but the model cannot spend tokens on runs
of whitespace (json_fence: ``(?:[ ]?|\n[ ]*)``, one space or a newline and an indent; a bounded indent,
``\n[ ]{0,16}``, would triple the DFA). Keys come in schema order ("name" before "arguments", arguments in the order
the function declares them) because outlines-core's schema regex emits properties in order; optional arguments may
be left out. Strings may hold any character but raw control characters and the JSON escapes, ``\\uXXXX`` included
(outlines-core's string pattern lacks it; ``json.dumps`` writes it for every non-ASCII character, so we add it).

**Special tokens as marker bytes.** outlines-core matches tokens by their bytes. Were ``<tool_call>`` given to it as
its text, the special token would also be allowed *inside any string value* (its text is valid string content), and so
would ``<|im_end|>``, which ends generation mid-string. So the framing tokens enter the vocabulary as single control
bytes that no JSON string may contain: ``<tool_call>`` = ``\x02``, ``</tool_call>`` = ``\x03``, the end of turn
(``<|im_end|>``) = ``\x04``; ordinary tokens holding those bytes are left out (valid output never contains them),
and the regex uses the same bytes. A tokenizer without ``<tool_call>`` special tokens gets the literal text instead
(spelled with ordinary tokens). All other special tokens are excluded.

**outlines-core 0.2.14 defect, and the workaround.** In 0.2.14 the index drops transitions out of a *final* state
(a complete match) into non-final states: ``x(,x)*`` after ``x`` refuses ``,`` (fixed upstream, not released). A
single call object is unaffected (nothing follows its closing brace), repeated calls are: after the first
``</tool_call>`` the separating ``\n`` would be refused. Two measures: (1) the end of turn is part of every regex
(the ``\x04`` marker is its last symbol), so no state is final before the turn is over; outlines-core's own EOS
(allowed only in final states) is given an id that never matters, another EOS id of the tokenizer
(``<|endoftext|>`` for Qwen); (2) a parallel ``tool_call`` regex holds one block followed by ``\n`` *or* the end of
turn, and the host restarts the guide after ``\n`` (``Guide.reset``): exact, since the next symbol is the atomic
``<tool_call>`` token, and it builds the call automaton once (outlines-core does not minimise its DFA, so
``call(\ncall)*`` has twice the states and compile time). ``tests/test_grammar.py`` keeps a strict-xfail test of the
raw defect, which fails (XPASS) once a fixed release is installed.

**Roles from parser states.** Once per compiled grammar, a breadth-first walk of ``Index.get_transitions()`` from the
initial state keeps one witness byte string per state (and one witness token per distinct state-to-state edge) and
classifies it with a small JSON lexer, run incrementally (a new state's lexer state is its parent's fed with one
token's bytes). Online, the role of a generated token is one dict lookup keyed by the transition it took,
``(state before, state after)``; the end-of-turn token is END_OF_TURN by its id. We key by the transition, not the
state after alone, because Qwen ends every call with the single token ``}}\n``, which reaches the same state as a
bare ``\n``: the transition tells the STRUCTURAL token from the FRAMING one. A token's role is that of its last byte,
skipping trailing whitespace / framing bytes when it has other bytes; quotes belong to their string (``{"`` opening an
argument key is ARG_KEY, ``",`` is STRUCTURAL); the envelope keys ``"name"`` / ``"arguments"`` and all braces,
brackets, commas and colons are STRUCTURAL; bytes outside the JSON (markers, fences, newlines around and between
calls) are FRAMING. Limits: tokens on one edge share its witness's role, and where the DFA merges two positions with
the same future (the end of ``"abc"`` and of ``true`` for an argument of type "any") the first witness decides.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import json
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.roles import Role

FRAMINGS = ("tool_call", "json_fence")
TIGHT_WHITESPACE = r"[ ]?"
FENCE_WHITESPACE = r"(?:[ ]?|\n[ ]*)"  # json_fence: the model pretty-prints inside fences (newline + indent)
GRAMMAR_CACHE_SIZE = 64

CALL_OPEN, CALL_CLOSE, END_OF_TURN = b"\x02", b"\x03", b"\x04"  # marker bytes of the framing special tokens
_MARKER_BYTES = frozenset(CALL_OPEN + CALL_CLOSE + END_OF_TURN)

# outlines-core's JSON string escapes lack \uXXXX; json.dumps writes it for every non-ASCII character.
_OUTLINES_ESCAPE = r'\\["\\/bfnrt]'
_JSON_ESCAPE = r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'


class GrammarError(ValueError):
    """A tool list cannot be turned into a grammar; the message names the function, the cause and the fix."""


# ---------------------------------------------------------------------------------------------------------------
# BFCL function dict -> JSON Schema


_SCALAR = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}
_FLAT = {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}]}
# Values without a schema are kept shallow: every container level multiplies the automaton. BFCL's golds need no
# more (its "any" values are scalars; free-form dicts map keys to scalars or lists of scalars). outlines-core turns the
# empty schema {} into an unparenthesised alternation that breaks the surrounding regex, so "any" is spelled out.
ANY_VALUE = {
    "anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]
}
FREE_DICT_VALUE = _FLAT  # values of a "dict" without properties
FREE_ITEM = _FLAT  # items of an "array" / "tuple" without items
_TYPES = {  # BFCL (and JSON Schema) type name -> JSON Schema type
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
# Value constraints passed through to outlines-core. BFCL's "format" (e.g. "date") is advisory, as is "maximum"
# (outlines-core ignores bounds); ground truths do not always follow them, so they are dropped.
_PASSED_THROUGH = ("pattern", "minLength", "maxLength", "minItems", "maxItems")


def _param_schema(spec: Any, function: str, path: str, enums: bool) -> dict:
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
        return copy.deepcopy(ANY_VALUE)
    if not isinstance(kind, str) or kind not in _TYPES:
        raise GrammarError(
            f"{where}: unsupported type {kind!r}; use one of {sorted(_TYPES)} or 'any' (BFCL's types are dict, float, "
            "tuple, any, integer, string, boolean, array)"
        )
    out: dict[str, Any] = {"type": _TYPES[kind]}
    for key in _PASSED_THROUGH:
        if key in spec:
            out[key] = spec[key]
    if out["type"] == "array":
        items = spec.get("items")
        out["items"] = (
            _param_schema(items, function, f"{path}[]", enums) if items is not None else copy.deepcopy(FREE_ITEM)
        )
    elif out["type"] == "object":
        if "properties" not in spec:  # a free-form dict: any keys, shallow values
            out["additionalProperties"] = copy.deepcopy(FREE_DICT_VALUE)
        else:
            out.update(_object_schema(spec["properties"], spec.get("required", []), function, f"{path}.", enums))
    return out


def _object_schema(properties: Any, required: Any, function: str, prefix: str, enums: bool) -> dict:
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
        "properties": {name: _param_schema(p, function, prefix + name, enums) for name, p in properties.items()},
        "required": list(required),
        "additionalProperties": False,
    }


def tool_schema(function: dict, *, enums: bool = True) -> dict:
    """A BFCL function dict -> the JSON Schema of one call object ``{"name": <its name>, "arguments": {...}}``.

    BFCL types map to JSON Schema: dict -> object (free-form if it has no properties), float -> number, tuple ->
    array, any -> any JSON value (one container deep), integer / string / boolean / array kept; required arguments
    are required, optional ones may be omitted, no others are allowed (``additionalProperties: false``).
    Descriptions, defaults, formats and bounds are not constraints. With ``enums`` (default) an enum decides the
    values on its own (BFCL has type "boolean" with enum ["True", "False", "dontcare"]); ``enums=False`` drops enums
    and keeps the types. Of BFCL's 2,351 golds (rendered canonically, in schema key order) the default grammar
    refuses 21: 7 name a value outside their parameter's enum (accepted with ``enums=False``), 14 give a value of
    another type than their schema declares (``true`` for a string, ``null`` for an optional string, a list for a
    string, ...) or are unsatisfiable under BFCL's checker anyway.
    """
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise GrammarError(f"a function must be a dict with a string 'name', got {str(function)[:120]!r}")
    name = function["name"]
    parameters = function.get("parameters", {"type": "dict", "properties": {}})
    if not isinstance(parameters, dict):
        raise GrammarError(f"function {name!r}: 'parameters' must be a dict (a BFCL 'dict' schema); fix the tool list")
    properties, required = parameters.get("properties", {}), parameters.get("required", [])
    arguments = {"type": "object", **_object_schema(properties, required, name, "", enums)}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary


@dataclasses.dataclass(eq=False)
class GrammarVocabulary:
    """A tokenizer's tokens as outlines-core sees them (raw bytes; framing special tokens as marker bytes)."""

    vocabulary: Vocabulary
    key: str  # content hash: compiled grammars are cached per (schemas, framing, parallel, ..., key)
    token_bytes: list[bytes]  # id -> the bytes the index matches (b"" for ids the grammar never allows)
    call_open: str  # regex fragments of the framing symbols
    call_close: str
    end_of_turn: str
    end_of_turn_id: int
    stop_ids: tuple[int, ...]  # the tokenizer's EOS ids: what a finished row may still emit
    size: int  # the tokenizer's vocabulary size


_VOCABS: weakref.WeakKeyDictionary[Tokenizer, GrammarVocabulary] = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


def grammar_vocabulary(tokenizer: Tokenizer) -> GrammarVocabulary:
    """The outlines-core vocabulary of ``tokenizer`` (cached per tokenizer object; ~0.5 s for Qwen's 151k ids)."""
    with _VOCAB_LOCK:
        if tokenizer in _VOCABS:
            return _VOCABS[tokenizer]
    all_bytes = tokenizer.all_token_bytes()
    special = tokenizer.special_tokens
    end_id = special.get("<|im_end|>", tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None)
    if end_id is None:
        raise GrammarError("the tokenizer declares no end-of-turn token (<|im_end|> or an EOS id); cannot end a turn")
    markers = {end_id: END_OF_TURN}
    call_open, call_close = re.escape("<tool_call>"), re.escape("</tool_call>")
    if "<tool_call>" in special and "</tool_call>" in special:
        markers[special["<tool_call>"]] = CALL_OPEN
        markers[special["</tool_call>"]] = CALL_CLOSE
        call_open, call_close = r"\x02", r"\x03"
    special_ids = set(special.values())
    # outlines-core allows its EOS only in final states; ours are final only after the end-of-turn marker, so its EOS
    # just has to be an id outside the token map.
    spare = [i for i in (*tokenizer.eos_token_ids, *sorted(special_ids)) if i not in markers]
    if not spare:
        raise GrammarError("the tokenizer has no spare special token to serve as outlines-core's EOS id")
    token_bytes: list[bytes] = []
    tokens: dict[bytes, list[int]] = {}
    for i, raw in enumerate(all_bytes):
        if i in markers:
            raw = markers[i]
        elif i in special_ids or not raw or _MARKER_BYTES.intersection(raw):
            raw = b""
        token_bytes.append(raw)
        if raw:
            tokens.setdefault(raw, []).append(i)
    digest = hashlib.sha256()
    for i, raw in enumerate(token_bytes):
        digest.update(b"%d:%d:" % (i, len(raw)) + raw)
    vocab = GrammarVocabulary(
        vocabulary=Vocabulary(spare[0], tokens),
        key=digest.hexdigest()[:32],
        token_bytes=token_bytes,
        call_open=call_open,
        call_close=call_close,
        end_of_turn=r"\x04",
        end_of_turn_id=end_id,
        stop_ids=tuple(dict.fromkeys([end_id, *tokenizer.eos_token_ids])),
        size=len(all_bytes),
    )
    with _VOCAB_LOCK:
        _VOCABS[tokenizer] = vocab
    return vocab


# ---------------------------------------------------------------------------------------------------------------
# Regex


def _function_regex(function: dict, whitespace: str, enums: bool) -> str:
    schema = tool_schema(function, enums=enums)
    try:
        regex = build_regex_from_schema(json.dumps(schema), whitespace)
    except Exception as exc:  # outlines-core raises ValueError / TypeError / its own errors
        raise GrammarError(
            f"function {function['name']!r}: outlines-core cannot build a regex from its schema ({exc}); "
            "simplify or fix that parameter's schema (supported: BFCL types, enum, properties/required, items)"
        ) from exc
    if _OUTLINES_ESCAPE in regex:
        regex = regex.replace(_OUTLINES_ESCAPE, _JSON_ESCAPE)
    return regex


def _calls_regex(functions: Sequence[dict], whitespace: str, enums: bool) -> str:
    if not functions:
        raise GrammarError("the tool list is empty: a tool-call grammar needs at least one function")
    return "(?:" + "|".join(f"(?:{_function_regex(f, whitespace, enums)})" for f in functions) + ")"


def _check_framing(framing: str) -> None:
    if framing not in FRAMINGS:
        raise GrammarError(f"unknown framing {framing!r}; choose one of {FRAMINGS}")


def tool_call_regex(
    functions: Sequence[dict],
    framing: str = "tool_call",
    parallel: bool = True,
    *,
    vocab: GrammarVocabulary | None = None,
    whitespace: str | None = None,
    host_repeat: bool = True,
    enums: bool = True,
) -> str:
    """The regex of an assistant turn: one call (``parallel``: one or more, separated by newlines), then the end.

    ``tool_call``: ``<tool_call>\\n{call}\\n</tool_call>``, parallel calls separated by ``\\n``. With
    ``host_repeat`` (what ``compile_grammar`` uses when the tokenizer has ``<tool_call>`` special tokens) the
    parallel regex holds **one** call followed by either the separator or the end of turn, and the host restarts the
    guide after a separator: the call's automaton is built once, where the whole-language regex (``host_repeat=False``:
    ``call (\\n call)* end``) repeats it and, as outlines-core does not minimise its DFA, doubles the states and the
    compile time. The restart is exact because the next symbol, ``<tool_call>``, is a special token that no token can
    straddle.
    ``json_fence``: a fence, ``json``, newline, the call, newline, a closing fence; parallel calls are JSON lines inside
    the one fence (``{call}\\n{call}``: what Qwen2.5-Coder writes when it makes several calls), as a whole-language
    regex (a restarted guide would expect a new fence, not the next call).
    ``vocab`` supplies the framing symbols (default: Qwen's special tokens as the marker bytes ``\\x02``,
    ``\\x03``, ``\\x04``); ``whitespace`` overrides the framing's whitespace pattern inside the JSON.
    """
    _check_framing(framing)
    call_open, call_close, end = (
        (vocab.call_open, vocab.call_close, vocab.end_of_turn) if vocab is not None else (r"\x02", r"\x03", r"\x04")
    )
    if framing == "json_fence":
        call = _calls_regex(functions, FENCE_WHITESPACE if whitespace is None else whitespace, enums)
        calls = f"{call}(?:\\n{call})*" if parallel else call
        return f"```json\\n{calls}\\n```{end}"
    call = _calls_regex(functions, TIGHT_WHITESPACE if whitespace is None else whitespace, enums)
    block = f"{call_open}\\n{call}\\n{call_close}"
    if not parallel:
        return f"{block}{end}"
    if host_repeat:
        return f"{block}(?:\\n|{end})"
    return f"{block}(?:\\n{block})*{end}"


# ---------------------------------------------------------------------------------------------------------------
# A small JSON lexer over the witness bytes: the role of each byte


# Lexer state (immutable, so BFS children share their parent's safely):
#   (stack, string, scalar)
#   stack: tuple of frames (kind, expect, key); kind: "env" (a call object) | "args" (its arguments) | "obj" |
#          "arr" | "list" (a top-level list of calls); expect: "key" | "value" (objects); key: the envelope's
#          current key (env only)
#   string: None | (role, is_key, escaped, text)   text: the key's bytes so far (env keys only)
#   scalar: None | role (inside a number or literal)
LexState = tuple
LEX_START: LexState = ((), None, None)
_WS = frozenset(b" \t\r\n")
_NUMBER_START = frozenset(b"-0123456789")
_SCALAR_BYTES = frozenset(b"0123456789+-.eEtruefalsn")


def lex_step(state: LexState, byte: int) -> tuple[LexState, int]:
    """Feed one byte: -> (new state, role of that byte)."""
    stack, string, scalar = state
    if string is not None:
        role, is_key, escaped, text = string
        if escaped:
            return (stack, (role, is_key, False, text), None), role
        if byte == 0x5C:  # backslash
            return (stack, (role, is_key, True, text), None), role
        if byte == 0x22:  # closing quote
            if is_key:
                kind, _, key = stack[-1]
                key = text.decode("utf-8", "replace") if kind == "env" else key
                stack = (*stack[:-1], (kind, "value", key))
            return (stack, None, None), role
        text = text + bytes([byte]) if text is not None else None
        return (stack, (role, is_key, False, text), None), role
    if scalar is not None and byte in _SCALAR_BYTES:
        return state, scalar
    if not stack:
        if byte == 0x7B:  # {
            return ((("env", "key", None),), None, None), Role.STRUCTURAL
        if byte == 0x5B:  # [
            return ((("list", "value", None),), None, None), Role.STRUCTURAL
        return (stack, None, None), Role.END_OF_TURN if byte == END_OF_TURN[0] else Role.FRAMING
    kind, expect, key = stack[-1]
    if byte in _WS:
        return (stack, None, None), Role.WHITESPACE
    if byte == 0x7B:
        child = "env" if kind == "list" else "args" if kind == "env" and key == "arguments" else "obj"
        return ((*stack, (child, "key", None)), None, None), Role.STRUCTURAL
    if byte == 0x5B:
        return ((*stack, ("arr", "value", None)), None, None), Role.STRUCTURAL
    if byte in (0x7D, 0x5D):  # } ]
        return (stack[:-1], None, None), Role.STRUCTURAL
    if byte == 0x2C:  # ,
        if kind in ("env", "args", "obj"):
            stack = (*stack[:-1], (kind, "key", key))
        return (stack, None, None), Role.STRUCTURAL
    if byte == 0x3A:  # :
        return (stack, None, None), Role.STRUCTURAL
    if byte == 0x22:  # opening quote
        if kind in ("env", "args", "obj") and expect == "key":
            role = Role.STRUCTURAL if kind == "env" else Role.ARG_KEY
            return (stack, (role, True, False, b"" if kind == "env" else None), None), role
        role = Role.FUNCTION_NAME if kind == "env" and key == "name" else Role.ARG_STRING
        return (stack, (role, False, False, None), None), role
    if byte in _NUMBER_START:
        return (stack, None, Role.ARG_NUMBER), Role.ARG_NUMBER
    if byte in b"tfn":
        return (stack, None, Role.ARG_LITERAL), Role.ARG_LITERAL
    return (stack, None, None), Role.FREE_TEXT


def lex_roles(text: bytes, state: LexState = LEX_START) -> list[int]:
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


# ---------------------------------------------------------------------------------------------------------------
# Compiled grammars


_AMBIGUOUS = -1  # edge_roles value: the edge's tokens differ in role; look the token up in token_roles


@dataclasses.dataclass(eq=False)
class CompiledGrammar:
    """An outlines-core Index for one tool list, plus its role tables.

    ``edge_roles[(state before, state after)]`` is the role of a token taking that transition (the online lookup;
    where the tokens of one edge differ, ``token_roles[(state before, token)]``); ``state_roles[state]`` the role of
    the last byte of a token reaching ``state`` (the fallback); the end-of-turn token is END_OF_TURN wherever it is.
    A final state reached by the end-of-turn token ends the turn; reached by any other token (the separator after a
    parallel call), the host restarts the guide (``Guide.reset``) for the next call. (The DFA merges both ends into
    one final state, so the token, not the state, tells them apart.)
    """

    index: Index
    regex: str
    function_names: tuple[str, ...]
    framing: str
    parallel: bool
    vocab: GrammarVocabulary
    edge_roles: dict[tuple[int, int], int]
    token_roles: dict[tuple[int, int], int]  # (state before, token) -> role, for edges whose tokens differ
    state_roles: dict[int, int]
    witnesses: dict[int, bytes]  # one byte string reaching each state (for error messages and tests)
    final_states: frozenset[int]
    compile_s: float  # regex + Index construction
    roles_s: float  # the breadth-first role walk

    @property
    def initial_state(self) -> int:
        return self.index.get_initial_state()

    @property
    def num_states(self) -> int:
        return len(self.witnesses)

    def token_role(self, before: int, after: int, token: int) -> int:
        """Role of ``token``, which took the index from ``before`` to ``after``: one dict lookup."""
        if token == self.vocab.end_of_turn_id:
            return Role.END_OF_TURN
        role = self.edge_roles.get((before, after))
        if role == _AMBIGUOUS:
            role = self.token_roles.get((before, token))
        return role if role is not None else self.state_roles.get(after, Role.FREE_TEXT)

    def walk(self, token_ids: Sequence[int]) -> tuple[list[int], bool] | None:
        """Follow ``token_ids`` as ``GrammarConstraint`` does: -> (each token's role, whether the turn is complete),
        or None when a token is refused. Tokens after the end of turn are refused."""
        state, roles, ended = self.initial_state, [], False
        for token in map(int, token_ids):
            nxt = None if ended else self.index.get_next_state(state, token)
            if nxt is None:
                return None
            roles.append(self.token_role(state, nxt, token))
            ended = nxt in self.final_states and token == self.vocab.end_of_turn_id
            state = self.initial_state if nxt in self.final_states and not ended else nxt
        return roles, ended

    def accepts(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` is one complete assistant turn of this grammar."""
        walked = self.walk(token_ids)
        return walked is not None and walked[1]


EXACT_ROLES_LIMIT = 4096  # states with at most this many outgoing tokens have every token lexed


def _role_tables(index: Index, vocab: GrammarVocabulary) -> tuple[dict, dict, dict, dict]:
    """Breadth-first walk from the initial state: one witness per state, roles per edge (and per token if needed).

    A state with at most ``EXACT_ROLES_LIMIT`` outgoing tokens has every token lexed: an edge whose tokens disagree
    (e.g. ``' null'`` and ``' ""'`` ending an argument of type "any" in the same state) keeps a role per
    (state, token). Larger states (string contents: ~150k tokens, all one role) are classified by one token per edge.
    """
    transitions = index.get_transitions()
    start = index.get_initial_state()
    lex: dict[int, LexState] = {start: LEX_START}
    witnesses: dict[int, bytes] = {start: b""}
    state_roles: dict[int, int] = {}
    edge_roles: dict[tuple[int, int], int] = {}
    token_roles: dict[tuple[int, int], int] = {}
    queue = collections.deque([start])

    def visit(state: int, token: int, nxt: int) -> int | None:
        raw = vocab.token_bytes[token] if token < len(vocab.token_bytes) else b""
        if not raw or token == vocab.end_of_turn_id:  # outlines-core's EOS loop; END_OF_TURN goes by its id
            return None
        lex_state, role, last = lex_token(lex[state], raw)
        if nxt not in lex:
            lex[nxt], witnesses[nxt], state_roles[nxt] = lex_state, witnesses[state] + raw, last
            queue.append(nxt)
        return role

    while queue:
        state = queue.popleft()
        out = transitions.get(state, {})
        if len(out) > EXACT_ROLES_LIMIT:
            for nxt, token in dict(zip(out.values(), out.keys(), strict=True)).items():  # one token per edge
                role = visit(state, token, nxt)
                if role is None and token == vocab.end_of_turn_id:  # let another token witness the edge
                    token = next((t for t, n in out.items() if n == nxt and t != token), None)
                    role = None if token is None else visit(state, token, nxt)
                if role is not None:
                    edge_roles[(state, nxt)] = role
            continue
        per_edge: dict[int, dict[int, int]] = {}
        for token, nxt in out.items():
            role = visit(state, token, nxt)
            if role is not None:
                per_edge.setdefault(nxt, {})[token] = role
        for nxt, roles in per_edge.items():
            kinds = set(roles.values())
            if len(kinds) == 1:
                edge_roles[(state, nxt)] = kinds.pop()
            else:
                edge_roles[(state, nxt)] = _AMBIGUOUS
                token_roles.update({(state, token): role for token, role in roles.items()})
    return edge_roles, token_roles, state_roles, witnesses


def _cache_key(functions: Sequence[dict], framing: str, parallel: bool, whitespace: str | None, enums: bool, vocab):
    schemas = json.dumps([tool_schema(f, enums=enums) for f in functions], sort_keys=True)
    return (hashlib.sha256(schemas.encode()).hexdigest(), framing, parallel, whitespace, vocab.key)


_GRAMMARS: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
_GRAMMAR_LOCK = threading.Lock()


def compile_grammar(
    functions: Sequence[dict],
    tokenizer: Tokenizer,
    framing: str = "tool_call",
    parallel: bool = True,
    *,
    whitespace: str | None = None,
    enums: bool = True,
) -> CompiledGrammar:
    """Compile (or fetch from the LRU cache) the grammar of one tool list for ``tokenizer``.

    The cache (``GRAMMAR_CACHE_SIZE`` entries) is keyed by the functions' derived schemas (descriptions do not
    matter), framing, parallel, whitespace, enums and the vocabulary's content hash. Index construction dominates
    (Qwen's 151k-token vocabulary, CPU seconds per BFCL tool list, tool_call framing): median ~1 s for single-function
    categories, ~2-3 s for multiple / parallel_multiple, ~6 s for live_multiple's long tool lists; up to ~9 s for a
    free-form dict (every string state carries ~150k token transitions; such an index holds ~60-90 MB). The role
    walk adds ~10%. Raises GrammarError naming the function when outlines-core cannot compile a schema.
    """
    _check_framing(framing)
    vocab = grammar_vocabulary(tokenizer)
    key = _cache_key(functions, framing, parallel, whitespace, enums, vocab)
    with _GRAMMAR_LOCK:
        if key in _GRAMMARS:
            _GRAMMARS.move_to_end(key)
            return _GRAMMARS[key]
    start = time.perf_counter()
    host_repeat = vocab.call_open == r"\x02"  # restart only before an atomic <tool_call> token
    regex = tool_call_regex(
        functions, framing, parallel, vocab=vocab, whitespace=whitespace, host_repeat=host_repeat, enums=enums
    )
    try:
        index = Index(regex, vocab.vocabulary)
    except Exception as exc:
        raise _index_error(functions, framing, vocab, whitespace, enums, exc) from exc
    compiled_at = time.perf_counter()
    edge_roles, token_roles, state_roles, witnesses = _role_tables(index, vocab)
    grammar = CompiledGrammar(
        index=index,
        regex=regex,
        function_names=tuple(f["name"] for f in functions),
        framing=framing,
        parallel=parallel,
        vocab=vocab,
        edge_roles=edge_roles,
        token_roles=token_roles,
        state_roles=state_roles,
        witnesses=witnesses,
        final_states=frozenset(index.get_final_states()),
        compile_s=compiled_at - start,
        roles_s=time.perf_counter() - compiled_at,
    )
    with _GRAMMAR_LOCK:
        _GRAMMARS[key] = grammar
        while len(_GRAMMARS) > GRAMMAR_CACHE_SIZE:
            _GRAMMARS.popitem(last=False)
    return grammar


def clear_grammar_cache() -> None:
    with _GRAMMAR_LOCK:
        _GRAMMARS.clear()


def _index_error(
    functions: Sequence[dict],
    framing: str,
    vocab: GrammarVocabulary,
    whitespace: str | None,
    enums: bool,
    exc: Exception,
) -> GrammarError:
    """Index construction failed for the whole tool list: name the function whose own regex fails.

    Each function is tried alone against a vocabulary of the 256 single bytes (which can spell any regex): fast,
    and regex errors do not depend on the vocabulary."""
    culprit = None
    if len(functions) > 1:
        tiny = Vocabulary(256, {bytes([i]): [i] for i in range(256)})
        for function in functions:
            try:
                Index(
                    tool_call_regex([function], framing, False, vocab=vocab, whitespace=whitespace, enums=enums), tiny
                )
            except Exception:
                culprit = function["name"]
                break
    names = repr(culprit) if culprit else ", ".join(repr(f["name"]) for f in functions)
    return GrammarError(
        f"function {names}: outlines-core cannot compile the tool-call grammar ({exc}); make parameter 'pattern's "
        "plain regular expressions (no look-around, no backreferences) or simplify that function's schema"
    )


# ---------------------------------------------------------------------------------------------------------------
# The engine-side constraint


class GrammarConstraint:
    """One outlines-core Guide per sequence: packed token masks before each step, token roles after it.

    Implements the engine's ``TokenConstraint`` protocol (``mask()``, ``advance(tokens)``). Rows may have different
    grammars. A row whose turn has ended (it took the end-of-turn token) is masked to the tokenizer's EOS ids and
    accepts any further token without error (the engine keeps stepping finished rows); those tokens get END_OF_TURN
    (an EOS id) or FREE_TEXT. ``mask_s`` / ``advance_s`` / ``steps`` count host seconds, for the parser time per step.
    """

    def __init__(self, grammars: Sequence[CompiledGrammar], vocab_size: int):
        if not grammars:
            raise ValueError("GrammarConstraint needs one compiled grammar per sequence, got none")
        for g in grammars:
            if vocab_size < g.vocab.size:
                raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {g.vocab.size} token ids")
        self.grammars = list(grammars)
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.guides = [Guide(g.index) for g in self.grammars]
        self.finished = np.zeros(len(self.grammars), bool)
        # After a parallel-call separator the guide restarts at <tool_call>; the turn may also end there (the model
        # often writes "\n" before <|im_end|>), which the restarted guide alone would refuse.
        self.between_calls = np.zeros(len(self.grammars), bool)
        self.mask_s = 0.0
        self.advance_s = 0.0
        self.steps = 0
        self._stop_rows = []
        for g in self.grammars:
            row = np.zeros(self.words, np.uint32)
            for token in g.vocab.stop_ids:
                row[token >> 5] |= np.uint32(1 << (token & 31))
            self._stop_rows.append(row.view(np.int32))

    @property
    def batch(self) -> int:
        return len(self.guides)

    def mask(self) -> np.ndarray:
        """i32[B, ceil(V/32)]: bit j of word w allows token 32w+j (written by ``Guide.write_mask_into``)."""
        start = time.perf_counter()
        out = np.zeros((self.batch, self.words), np.int32)
        for i, (grammar, guide) in enumerate(zip(self.grammars, self.guides, strict=True)):
            if self.finished[i]:
                out[i] = self._stop_rows[i]
            else:  # zero-fills and sets the words of the tokenizer's ids; the model's padding ids stay 0
                guide.write_mask_into(out[i].ctypes.data, -(-grammar.vocab.size // 32), 4)
                if self.between_calls[i]:
                    end = grammar.vocab.end_of_turn_id
                    out.view(np.uint32)[i, end >> 5] |= np.uint32(1 << (end & 31))
        self.mask_s += time.perf_counter() - start
        return out

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        """Feed each row its sampled token: -> i32[B] roles (looked up by the (before, after) state transition)."""
        start = time.perf_counter()
        tokens = np.asarray(tokens).reshape(-1)
        if tokens.shape[0] != self.batch:
            raise ValueError(f"advance got {tokens.shape[0]} tokens for a batch of {self.batch}")
        roles = np.empty(self.batch, np.int32)
        for i, (grammar, guide) in enumerate(zip(self.grammars, self.guides, strict=True)):
            token = int(tokens[i])
            if self.finished[i]:
                roles[i] = Role.END_OF_TURN if token in grammar.vocab.stop_ids else Role.FREE_TEXT
                continue
            if self.between_calls[i] and token == grammar.vocab.end_of_turn_id:
                self.finished[i], self.between_calls[i] = True, False
                roles[i] = Role.END_OF_TURN
                continue
            self.between_calls[i] = False
            state = guide.get_state()
            try:
                guide.advance(token, return_tokens=False)
            except Exception as exc:
                raw = grammar.vocab.token_bytes[token] if 0 <= token < grammar.vocab.size else b"?"
                raise ValueError(
                    f"row {i}: token {token} ({raw!r}) is not allowed by the grammar in state {state} (after "
                    f"{grammar.witnesses.get(state, b'?')[-60:]!r}); was the mask applied to the logits?"
                ) from exc
            after = guide.get_state()
            roles[i] = grammar.token_role(state, after, token)
            if after in grammar.final_states:
                if token == grammar.vocab.end_of_turn_id:
                    self.finished[i] = True
                else:
                    guide.reset()  # the separator after a parallel call: the next call starts afresh
                    self.between_calls[i] = True
        self.advance_s += time.perf_counter() - start
        self.steps += 1
        return roles

    def timing(self) -> dict[str, float]:
        """Host seconds spent in mask() and advance(), in total and per step."""
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "mask_s": self.mask_s,
            "advance_s": self.advance_s,
            "parser_s_per_step": (self.mask_s + self.advance_s) / steps,
        }

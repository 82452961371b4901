"""The llguidance grammar backend: the same turns as ``grammar.py``, with llguidance's JSON Schema compiler.

``grammar_backend="llguidance"`` (the default) compiles a request's tools or response schema with llguidance instead
of our schema-to-regex translation and outlines-core: wider JSON Schema coverage and millisecond compiles
(docs/results/schemas.md measures both engines). The turn is written as a Lark grammar whose
calls are ``%json`` schemas, one per tool, in the forms ``regex.py`` defines:

- ``tool_calls``: ``<tool_call>\\n{call}\\n</tool_call>`` blocks, parallel ones separated by ``\\n`` (a ``\\n`` may end
  the last where ``<tool_call>`` is a special token), then the end of turn; where the tokenizer has no
  ``<tool_call>`` special tokens, the markers are their text, spelled with ordinary tokens. ``json_fence`` framing:
  a ```` ```json ```` fence holding the calls as JSON lines, whitespace inside the JSON as ``regex.FENCE_WHITESPACE``;
- ``auto``: those, a bare call, a call in a json fence, or a text answer that does not open with ``{`` or a
  backtick (``regex.FREE_TEXT``: the same steering rule);
- ``json``: one JSON value of the response schema (any object for ``json_object``).

Whitespace between JSON tokens is ours (``[ ]?``), object keys come in the schema's order and an object that
declares ``properties`` gets those keys only (``declared_keys_only``, our translation's rule), so both backends admit
the same outputs wherever both compile a schema (objects without ``properties`` aside: ours keeps their values
shallow). PASK's roles do not depend on the backend: each token's bytes go through the byte-level lexer
(``lexer.py``) that our grammar's role tables are built from, and the called tool is read from the call's bytes, so a
request gets the same roles, and the same schema-conditioned release, from either backend.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np

from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.constraint import RowConstraint
from pask_jax.structure.lexer import LEX_AUTO, LEX_CALLS, LEX_JSON, LexState, lex_token
from pask_jax.structure.regex import FENCE_WHITESPACE, TIGHT_WHITESPACE, check_choice
from pask_jax.structure.roles import Role
from pask_jax.structure.schema import GrammarError
from pask_jax.structure.vocabulary import CALL_CLOSE, GrammarVocabulary, grammar_vocabulary

INSTALL_HINT = "grammar_backend 'llguidance' needs the llguidance package: pip install llguidance==1.9.1"
# regex.FREE_TEXT without the marker bytes, which llguidance's special tokens never match as text
_TEXT = r"/[ \t\r\n]*[^{` \t\r\n][\s\S]*/"
_START_LEXEMES = {"tool_calls": LEX_CALLS, "auto": LEX_AUTO, "json": LEX_JSON}


@dataclasses.dataclass(eq=False)
class GuidanceGrammar:
    """One turn as an llguidance grammar; ``kind``, ``function_names`` and ``vocab`` as in ``CompiledGrammar``."""

    grammar: str  # the serialized llguidance grammar (Lark)
    kind: str
    function_names: tuple[str, ...]
    parallel: bool
    vocab: GrammarVocabulary  # token bytes with the framing markers, for the lexer's roles
    tokenizer: object  # llguidance.LLTokenizer
    compile_s: float


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:
        raise GrammarError(INSTALL_HINT) from None
    return llguidance


class _Wrapped:
    """A tokenizer as llguidance's ``TokenizerWrapper`` wants one: each id's bytes, special ids marked as such."""

    def __init__(self, tokenizer: Tokenizer, end_id: int):
        special = set(tokenizer.special_tokens.values())
        self.tokenizer = tokenizer
        self.tokens = [
            f"<special {i}>".encode() if i in special or not raw else raw
            for i, raw in enumerate(tokenizer.all_token_bytes())
        ]
        self.special_token_ids = sorted(special)
        self.eos_token_id = end_id
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8", errors="replace"))


_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, object] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _lltokenizer(tokenizer: Tokenizer, vocab: GrammarVocabulary):
    """llguidance's tokenizer for ``tokenizer``, ending turns with its end-of-turn id (cached per tokenizer)."""
    llg = _llguidance()
    with _LOCK:
        if tokenizer not in _TOKENIZERS:
            wrapped = _Wrapped(tokenizer, vocab.end_of_turn_id)
            _TOKENIZERS[tokenizer] = llg.LLTokenizer(llg.TokenizerWrapper(wrapped))
        return _TOKENIZERS[tokenizer]


# where subschemas sit: one schema, a list of them, or a mapping of names to them (``allOf`` stays as written)
_ONE_SCHEMA = ("items", "additionalProperties", "contains")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def declared_keys_only(schema: dict) -> dict:
    """In place: every object that declares ``properties`` generates those keys only (``additionalProperties``
    false), as our translation does (``schema.py``: a narrowing, every output still valid; a model under a small
    cache otherwise invents keys the function does not declare). An object with an ``allOf`` is left as written,
    branches included: closing a part would refuse the keys the other parts declare."""
    if not isinstance(schema, dict) or "allOf" in schema:
        return schema
    for key in _ONE_SCHEMA:
        declared_keys_only(schema.get(key))
    for key in _SCHEMA_LISTS:
        for sub in schema.get(key) if isinstance(schema.get(key), list) else ():
            declared_keys_only(sub)
    for key in _SCHEMA_MAPS:
        for sub in schema.get(key).values() if isinstance(schema.get(key), dict) else ():
            declared_keys_only(sub)
    if isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False
    return schema


def _schema_rule(schema: dict, whitespace: str) -> str:
    """``%json`` of ``schema`` (objects closed: ``declared_keys_only``) with our whitespace between its tokens."""
    schema = declared_keys_only(copy.deepcopy(schema))
    schema["x-guidance"] = {"whitespace_pattern": whitespace, "whitespace_flexible": False}
    return f"%json {json.dumps(schema)}"


def _call_schema(function: dict) -> dict:
    """``{"name": <the name>, "arguments": <its parameters>}``, the parameters' definitions kept at the root."""
    parameters = copy.deepcopy(function["parameters"])
    root = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return root | {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _check(llg, tokenizer, grammar: str, where: str) -> None:
    """Refuse, naming what llguidance says, a grammar it cannot compile."""
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarError(f"{where}: llguidance cannot compile the schema: {error.splitlines()[0]}")


def compile_guidance_grammar(
    functions: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    tool_choice: str = "required",
    parallel: bool = True,
    whitespace: str | None = None,
    framing: str = "tool_call",
) -> GuidanceGrammar:
    """Function dicts (``parse_tools``) -> the llguidance grammar of a turn of calls (``"auto"``: or a text)."""
    start = time.perf_counter()
    vocab = grammar_vocabulary(tokenizer)
    check_choice(framing, tool_choice, vocab)
    llg = _llguidance()
    lltok = _lltokenizer(tokenizer, vocab)
    fenced = framing == "json_fence"
    ws = whitespace if whitespace is not None else FENCE_WHITESPACE if fenced else TIGHT_WHITESPACE
    rules = [f"call_{i}: {_schema_rule(_call_schema(f), ws)}" for i, f in enumerate(functions)]
    for i, (function, rule) in enumerate(zip(functions, rules, strict=True)):
        _check(llg, lltok, f"start: call_{i}\n{rule}", f"tools[{i}] ({function['name']!r})")
    if fenced:  # the calls as JSON lines in one fence (regex.tool_call_regex)
        lines = 'call ("\\n" call)*' if parallel else "call"
        block, calls = f'"```json\\n" {lines} "\\n```"', "block"
    else:
        call_open, call_close = _markers(tokenizer, vocab)
        block = f'{call_open} "\\n" call "\\n" {call_close}'
        # as our regexes: a "\\n" may end parallel calls only where the host restarts at an atomic <tool_call>
        calls = 'block ("\\n" block)*' + (' "\\n"?' if vocab.atomic_calls else "") if parallel else "block"
    start_rule = {"required": calls, "auto": f'{calls} | call | "```json\\n" call "\\n```" | {_TEXT}'}[tool_choice]
    grammar = "\n".join(
        [f"start: {start_rule}", f"block: {block}", "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        + rules
    )
    kind = "tool_calls" if tool_choice == "required" else "auto"
    names = tuple(f["name"] for f in functions)
    compile_s = time.perf_counter() - start
    return GuidanceGrammar(grammar, kind, names, parallel, vocab, lltok, compile_s)


def _markers(tokenizer: Tokenizer, vocab: GrammarVocabulary) -> tuple[str, str]:
    """``<tool_call>`` and ``</tool_call>`` in the grammar: their special tokens, or their text where the tokenizer
    has no such tokens (as ``vocabulary.grammar_vocabulary`` decides)."""
    names = ("<tool_call>", "</tool_call>")
    if vocab.atomic_calls:
        return tuple(f"<[{tokenizer.special_tokens[name]}]>" for name in names)
    return tuple(json.dumps(name) for name in names)


def compile_guidance_json_grammar(
    schema: dict | None, tokenizer: Tokenizer, *, whitespace: str | None = None
) -> GuidanceGrammar:
    """The llguidance grammar of a ``response_format`` turn: one JSON value of ``schema`` (None: any object)."""
    start = time.perf_counter()
    vocab = grammar_vocabulary(tokenizer)
    llg = _llguidance()
    lltok = _lltokenizer(tokenizer, vocab)
    rule = _schema_rule({"type": "object"} if schema is None else schema, whitespace or TIGHT_WHITESPACE)
    grammar = f"start: {rule}"
    _check(llg, lltok, grammar, "response_format")
    return GuidanceGrammar(grammar, "json", (), False, vocab, lltok, time.perf_counter() - start)


class GuidanceConstraint(RowConstraint):
    """One llguidance matcher per sequence: packed token masks before each step, token roles after it.

    A ``TokenConstraint`` (a ``RowConstraint``), as ``GrammarConstraint`` is for our grammars. Roles come from the
    lexer over each token's bytes (a text answer's bytes through the prose lexer, so a call written there gets the
    call's roles); the called tool is forgotten after ``</tool_call>`` (the next call is not known yet).
    """

    def __init__(self, grammars: Sequence[GuidanceGrammar], vocab_size: int):
        llg = _llguidance()
        super().__init__(grammars, vocab_size)
        self.matchers = [llg.LLMatcher(g.tokenizer, g.grammar, log_level=0) for g in self.grammars]
        self._fill = llg.numpy.fill_next_token_bitmask
        self._bitmask = llg.numpy.allocate_token_bitmask(1, max(g.tokenizer.vocab_size for g in self.grammars))
        self._lex: list[LexState] = [_START_LEXEMES[g.kind] for g in self.grammars]
        self._after_close = np.zeros(len(self.grammars), bool)

    def _row_mask(self, row: int, out: np.ndarray) -> None:
        self._fill(self.matchers[row], self._bitmask, 0)  # llguidance packs its bitmask as we do
        words = min(self.words, self._bitmask.shape[1])
        out[:words] = self._bitmask[0, :words]

    def _row_advance(self, row: int, token: int) -> int:
        matcher, vocab = self.matchers[row], self.grammars[row].vocab
        if not matcher.consume_token(token):
            raise ValueError(
                f"row {row}: token {token} is not allowed by the grammar ({matcher.get_error() or 'refused'}); was "
                "the mask applied to the logits?"
            )
        if token == vocab.end_of_turn_id:
            self.finished[row] = True
            return Role.END_OF_TURN
        raw = vocab.token_bytes[token]
        if not raw:  # an id our vocabulary leaves out (it holds a marker byte): text, not structure
            return Role.FREE_TEXT
        self._lex[row], role, _ = lex_token(self._lex[row], raw)
        role = self._prose_role(row, role, raw)
        if self._after_close[row]:  # the separator after a call
            self._forget_called(row)
        self._after_close[row] = CALL_CLOSE in raw
        self._read_called(row, raw)
        return role

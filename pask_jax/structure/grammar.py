"""Compiled grammars: function dicts / a response schema -> regex -> outlines-core index, with token roles.

``compile_grammar`` builds the grammar of an assistant turn that calls tools (``tool_choice="required"``: one or
more calls; ``"auto"``: calls or a text answer), ``compile_json_grammar`` the grammar of a ``response_format``
turn (one JSON value). Both cache their result by the enforced schemas (descriptions do not matter), the options and
the vocabulary's content hash: in memory (LRU, ``GRAMMAR_CACHE_SIZE``) in front of a directory that outlives the
process (``grammar_cache``). What the regexes are: ``regex.py``; which schema keywords are enforced:
``schema.SCHEMA_KEYWORDS``.

**Roles from parser states.** Once per compiled grammar, a breadth-first walk of ``Index.get_transitions()`` from the
initial state keeps one witness byte string per state (and one witness token per distinct state-to-state edge) and
classifies it with a small JSON lexer, run incrementally (a new state's lexer state is its parent's fed with one
token's bytes). Online, the role of a generated token is one dict lookup keyed by the transition it took,
``(state before, state after)``; the end-of-turn token is END_OF_TURN by its id. We key by the transition, not the
state after alone, because Qwen ends every call with the single token ``}}\\n``, which reaches the same state as a
bare ``\\n``: the transition tells the STRUCTURAL token from the FRAMING one. A token's role is that of its last byte,
skipping trailing whitespace / framing bytes when it has other bytes; quotes belong to their string (``{"`` opening an
argument key is ARG_KEY, ``",`` is STRUCTURAL); the envelope keys ``"name"`` / ``"arguments"`` and all braces,
brackets, commas and colons are STRUCTURAL; bytes outside the JSON (markers, fences, newlines around and between
calls) are FRAMING; a text answer is FREE_TEXT (one looping state class). Limits: tokens on one edge share its
witness's role, and where the DFA merges two positions with the same future (the end of ``"abc"`` and of ``true``
for an argument of type "any") the first witness decides.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

from outlines_core import Index, Vocabulary

from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure import grammar_cache
from pask_jax.structure.grammar_cache import RoleTables
from pask_jax.structure.lexer import LEX_AUTO, LEX_CALLS, LEX_JSON, LexState, lex_token
from pask_jax.structure.regex import json_regex, tool_call_regex
from pask_jax.structure.roles import Role
from pask_jax.structure.schema import JSON_OBJECT, GrammarError
from pask_jax.structure.schema_rewrite import enforced_schema
from pask_jax.structure.vocabulary import GrammarVocabulary, grammar_vocabulary

GRAMMAR_CACHE_SIZE = 64
KINDS = ("tool_calls", "auto", "json")  # what the turn holds: calls | calls or a text answer | one JSON value
_AMBIGUOUS = -1  # edge_roles value: the edge's tokens differ in role; look the token up in token_roles


class Step(NamedTuple):
    """The result of feeding one token (``CompiledGrammar.step``)."""

    state: int  # the index state after it (the initial state again after a parallel-call separator)
    role: int
    ended: bool  # it ended the turn
    between_calls: bool  # it was a parallel-call separator: next comes <tool_call> or the end of turn


@dataclasses.dataclass(eq=False)
class CompiledGrammar:
    """An outlines-core Index for one tool list (or one response schema), plus its role tables.

    ``edge_roles[(state before, state after)]`` is the role of a token taking that transition (the online lookup;
    where the tokens of one edge differ, ``token_roles[(state before, token)]``); ``state_roles[state]`` the role of
    the last byte of a token reaching ``state`` (the fallback); the end-of-turn token is END_OF_TURN wherever it is.
    A final state reached by the end-of-turn token ends the turn; reached by any other token (the separator after a
    parallel call), the host restarts the guide (``Guide.reset``) for the next call, and the turn continues with
    ``<tool_call>`` or ends. (The DFA merges both ends into one final state, so the token, not the state, tells them
    apart.) ``kind`` and ``function_names`` say how to parse the output: ``"tool_calls"`` / ``"auto"`` hold calls of
    those functions (``"auto"``: or a text answer), ``"json"`` one JSON value.
    """

    index: Index
    regex: str
    kind: str
    function_names: tuple[str, ...]
    framing: str | None  # None for "json"
    parallel: bool
    vocab: GrammarVocabulary
    edge_roles: dict[tuple[int, int], int]
    token_roles: dict[tuple[int, int], int]  # (state before, token) -> role, for edges whose tokens differ
    state_roles: dict[int, int]
    witnesses: dict[int, bytes]  # one byte string reaching each state (for error messages and tests)
    final_states: frozenset[int]
    compile_s: float  # Index construction, or the load from the disk cache
    roles_s: float  # the breadth-first role walk (0 when loaded)

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

    def step(self, state: int, between_calls: bool, token: int) -> Step | None:
        """Feed ``token`` in ``state`` (``between_calls``: right after a parallel-call separator) -> the Step, or
        None when the grammar refuses it. ``GrammarConstraint`` and ``walk`` both go through here."""
        end = self.vocab.end_of_turn_id
        if between_calls:
            if token == end:
                return Step(state, Role.END_OF_TURN, True, False)
            if token != self.vocab.call_open_id:
                return None
        after = self.index.get_next_state(state, token)
        if after is None:
            return None
        role = self.token_role(state, after, token)
        if after not in self.final_states:
            return Step(after, role, False, False)
        if token == end:
            return Step(after, role, True, False)
        return Step(self.initial_state, role, False, True)

    def walk(self, token_ids: Sequence[int]) -> tuple[list[int], bool] | None:
        """Follow ``token_ids`` as ``GrammarConstraint`` does: -> (each token's role, whether the turn is complete),
        or None when a token is refused. Tokens after the end of turn are refused."""
        state, between, ended, roles = self.initial_state, False, False, []
        for token in map(int, token_ids):
            step = None if ended else self.step(state, between, token)
            if step is None:
                return None
            roles.append(step.role)
            state, between, ended = step.state, step.between_calls, step.ended
        return roles, ended

    def accepts(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` is one complete assistant turn of this grammar."""
        walked = self.walk(token_ids)
        return walked is not None and walked[1]


EXACT_ROLES_LIMIT = 4096  # states with at most this many outgoing tokens have every token lexed


def _role_tables(index: Index, vocab: GrammarVocabulary, start_lex: LexState) -> RoleTables:
    """Breadth-first walk from the initial state: one witness per state, roles per edge (and per token if needed).

    A state with at most ``EXACT_ROLES_LIMIT`` outgoing tokens has every token lexed: an edge whose tokens disagree
    (e.g. ``' null'`` and ``' ""'`` ending an argument of type "any" in the same state) keeps a role per
    (state, token). Larger states (string contents, free text: ~150k tokens, all one role) are classified by one
    token per edge.
    """
    transitions = index.get_transitions()
    start = index.get_initial_state()
    lex: dict[int, LexState] = {start: start_lex}
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
    return RoleTables(edge_roles, token_roles, state_roles, witnesses)


_GRAMMARS: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
_GRAMMAR_LOCK = threading.Lock()


def _compiled(regex: str, kind: str, names: tuple[str, ...], framing: str | None, parallel: bool, vocab, explain):
    """The cached grammar of ``regex`` (in memory, else on disk: ``grammar_cache``), or a new one; ``explain(exc)``
    -> the GrammarError when Index fails.

    The key is the regex itself (it holds the enforced schemas, the framing and the options, not descriptions)."""
    key = (hashlib.sha256(regex.encode()).hexdigest(), kind, framing, parallel, vocab.key)
    with _GRAMMAR_LOCK:
        if key in _GRAMMARS:
            _GRAMMARS.move_to_end(key)
            return _GRAMMARS[key]
    start = time.perf_counter()
    stored = grammar_cache.load(key)
    if stored is not None:
        index, tables = stored
        compile_s, roles_s = time.perf_counter() - start, 0.0  # loaded: the load is the whole cost
    else:
        index, tables, compile_s, roles_s = _build(regex, kind, vocab, explain)
        grammar_cache.store(key, index, tables)
    grammar = CompiledGrammar(
        index=index,
        regex=regex,
        kind=kind,
        function_names=names,
        framing=framing,
        parallel=parallel,
        vocab=vocab,
        **tables._asdict(),
        final_states=frozenset(index.get_final_states()),
        compile_s=compile_s,
        roles_s=roles_s,
    )
    with _GRAMMAR_LOCK:
        _GRAMMARS[key] = grammar
        while len(_GRAMMARS) > GRAMMAR_CACHE_SIZE:
            _GRAMMARS.popitem(last=False)
    return grammar


def _build(regex: str, kind: str, vocab: GrammarVocabulary, explain) -> tuple[Index, RoleTables, float, float]:
    """Compile ``regex`` over ``vocab`` and walk its roles -> (index, tables, Index seconds, walk seconds)."""
    start = time.perf_counter()
    try:
        index = Index(regex, vocab.vocabulary)
    except Exception as exc:
        raise explain(exc) from exc
    compiled_at = time.perf_counter()
    start_lex = {"tool_calls": LEX_CALLS, "auto": LEX_AUTO, "json": LEX_JSON}[kind]
    tables = _role_tables(index, vocab, start_lex)
    return index, tables, compiled_at - start, time.perf_counter() - compiled_at


def compile_grammar(
    functions: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    tool_choice: str = "required",
    parallel: bool = True,
    framing: str = "tool_call",
    whitespace: str | None = None,
    loosen: bool = False,
) -> CompiledGrammar:
    """Compile (or fetch from the memory or disk cache) the grammar of an assistant turn calling ``functions``
    (function dicts from ``parse_tools``).

    ``tool_choice="required"``: one or more calls (``parallel=False``: exactly one), then the end of turn;
    ``"auto"``: those, or a text answer (``tool_call`` framing with ``<tool_call>`` special tokens only). For a
    named function pass that function alone with "required"; "none" needs no grammar. Index construction dominates
    (Qwen's 151k-token vocabulary, CPU seconds per tool list, tool_call framing): median ~1 s for one function,
    ~2-3 s for a few, ~6 s for long tool lists of 10-20 functions; up
    to ~9 s for a free-form dict (every string state carries ~150k token transitions; such an index holds ~60-90 MB).
    The role walk adds ~10%. Raises GrammarError naming the function when a schema cannot be compiled, before the
    index is built when a keyword is not enforced (``loosen=True``: drop those constraints instead).
    """
    vocab = grammar_vocabulary(tokenizer)
    # the host restarts the guide between parallel calls only before an atomic <tool_call> token
    regex = tool_call_regex(
        functions, framing, parallel, tool_choice=tool_choice, vocab=vocab, whitespace=whitespace,
        host_repeat=vocab.atomic_calls, loosen=loosen,
    )  # fmt: skip

    def explain(exc: Exception) -> GrammarError:
        return _index_error(functions, framing, vocab, whitespace, loosen, exc)

    kind = "auto" if tool_choice == "auto" else "tool_calls"
    names = tuple(f["name"] for f in functions)
    return _compiled(regex, kind, names, framing, parallel, vocab, explain)


def compile_json_grammar(
    schema: dict | None, tokenizer: Tokenizer, *, whitespace: str | None = None, loosen: bool = False
) -> CompiledGrammar:
    """The grammar of a ``response_format`` turn: one JSON value of ``schema`` (``json_schema``), or any JSON object
    when ``schema`` is None (``json_object``; shallow, as any free-form object: its values are scalars or lists of
    scalars; ~5 s to compile for Qwen's vocabulary), then the end of turn. Keys are ARG_KEY, values ARG_STRING /
    ARG_NUMBER / ARG_LITERAL, punctuation STRUCTURAL. Raises GrammarError naming the keyword for what the grammar
    cannot enforce (``loosen=True``: drop the constraints it does not enforce instead)."""
    vocab = grammar_vocabulary(tokenizer)
    enforced = enforced_schema(JSON_OBJECT if schema is None else schema, "response_format", loosen=loosen)
    regex = json_regex(enforced, vocab=vocab, whitespace=whitespace)

    def explain(exc: Exception) -> GrammarError:
        return GrammarError(
            f"response_format: outlines-core cannot compile its schema ({exc}); make 'pattern's plain regular "
            "expressions (no look-around, no backreferences) or simplify the schema"
        )

    return _compiled(regex, "json", (), None, False, vocab, explain)


def _index_error(
    functions: Sequence[dict],
    framing: str,
    vocab: GrammarVocabulary,
    whitespace: str | None,
    loosen: bool,
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
                    tool_call_regex([function], framing, False, vocab=vocab, whitespace=whitespace, loosen=loosen), tiny
                )
            except Exception:
                culprit = function["name"]
                break
    names = repr(culprit) if culprit else ", ".join(repr(f["name"]) for f in functions)
    return GrammarError(
        f"function {names}: outlines-core cannot compile the tool-call grammar ({exc}); make parameter 'pattern's "
        "plain regular expressions (no look-around, no backreferences) or simplify that function's schema"
    )

"""The grammar backends behind one interface, chosen by name in one place (``backend_for``).

A backend compiles a turn's grammar (tool calls, or one JSON value of a response schema) for a tokenizer and gives
the ``TokenConstraint`` that decodes under it; the request side (``RequestBuilder``, ``LLM``) asks nothing else:

- ``"outlines"``: our schema-to-regex translation and outlines-core (``grammar.py``: ``CompiledGrammar``,
  ``constraint.GrammarConstraint``); tool schemas it cannot enforce exactly are refused when the request is parsed
  (a response schema before its grammar is compiled), the keyword and its place named;
- ``"outlines-loose"``: the same, but the constraints our translation does not enforce (LOOSENED in
  ``schema.SCHEMA_KEYWORDS``: ``multipleOf``, ``uniqueItems``, other formats, overlapping ``oneOf``) are dropped
  rather than refused: the explicit opt-in to a grammar that allows values the schema refuses;
- ``"llguidance"`` (``arguments.DEFAULT_GRAMMAR_BACKEND``): llguidance's JSON Schema compiler (``guidance.py``:
  ``GuidanceGrammar``, ``GuidanceConstraint``; llguidance is imported only when a grammar is compiled); it judges
  tool schemas when it compiles them;
- ``"auto"``: ``"outlines"`` for a turn whose schemas our translation enforces exactly, ``"llguidance"`` for one
  it cannot (``schema.Unenforceable``): every keyword enforced by one or the other; a batch may hold grammars of
  both (``constraint.SplitConstraint``). Where a schema needs llguidance and it is not installed, the error says so.

What both share, and all the request side reads of a compiled grammar, is ``Grammar``: the turn's ``kind``, the
callable ``function_names``, ``parallel``, the ``vocab`` (token bytes, framing ids) and ``compile_s``. A token's role
is the constraint's business under either backend (``TokenConstraint.advance``; both lex the token's bytes with
``lexer.py``), so PASK's roles and its release of unchosen tools do not depend on the backend.
"""

from __future__ import annotations

import abc
import importlib.util
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.constraint import GrammarConstraint, RowConstraint, SplitConstraint, TokenConstraint
from pask_jax.structure.grammar import CompiledGrammar, compile_grammar, compile_json_grammar
from pask_jax.structure.guidance import (
    INSTALL_HINT,
    GuidanceConstraint,
    GuidanceGrammar,
    compile_guidance_grammar,
    compile_guidance_json_grammar,
)
from pask_jax.structure.schema import JSON_OBJECT, GrammarError, Unenforceable
from pask_jax.structure.schema_rewrite import enforced_schema
from pask_jax.structure.tools import call_schema
from pask_jax.structure.vocabulary import GrammarVocabulary


class Grammar(Protocol):
    """A compiled grammar of one turn, as every backend gives it."""

    kind: str  # "tool_calls" | "auto" | "json" (grammar.KINDS)
    function_names: tuple[str, ...]  # the callable functions, in the order the called-tool indices count
    parallel: bool
    vocab: GrammarVocabulary
    compile_s: float


class GrammarBackend(abc.ABC):
    """Compiles turns to grammars and gives the constraint that decodes rows under them."""

    name: str
    grammar_type: ClassVar[type | tuple[type, ...]]  # what its compiles return
    constraint_type: ClassVar[type[RowConstraint]]

    @abc.abstractmethod
    def check_tools(self, functions: Sequence[dict]) -> None:
        """Refuse (GrammarError naming the function), when a request is parsed and before any compile, the tool
        schemas this backend knows it cannot compile."""

    @abc.abstractmethod
    def compile_calls(
        self,
        functions: Sequence[dict],
        tokenizer: Tokenizer,
        *,
        tool_choice: str = "required",
        parallel: bool = True,
        whitespace: str | None = None,
        framing: str = "tool_call",
    ) -> Grammar:
        """Function dicts (``parse_tools``) -> the grammar of a turn that calls them (``"auto"``: or a text answer)
        in ``framing`` (``regex.FRAMINGS``); GrammarError naming the function whose schema cannot be compiled."""

    @abc.abstractmethod
    def compile_json(self, schema: dict | None, tokenizer: Tokenizer, *, whitespace: str | None = None) -> Grammar:
        """The grammar of a ``response_format`` turn: one JSON value of ``schema`` (None: any object)."""

    def constraint(self, grammars: Sequence[Grammar], vocab_size: int) -> TokenConstraint:
        """The ``TokenConstraint`` of rows decoding under ``grammars`` (one per row, all compiled by this backend)
        over a model's ``vocab_size`` logits."""
        for g in grammars:
            if not isinstance(g, self.grammar_type):
                raise TypeError(f"grammar backend {self.name!r} cannot decode a {type(g).__name__}")
        return self.constraint_type(list(grammars), vocab_size)


class OutlinesBackend(GrammarBackend):
    """Ours: the schema translation of ``schema.py`` and outlines-core (``compile_grammar``, ``GrammarConstraint``);
    ``loosen``: drop the constraints the translation does not enforce instead of refusing them."""

    grammar_type = CompiledGrammar
    constraint_type = GrammarConstraint

    def __init__(self, *, loosen: bool = False):
        self.loosen = loosen
        self.name = "outlines-loose" if loosen else "outlines"

    def check_tools(self, functions):
        for function in functions:
            call_schema(function, loosen=self.loosen)

    def compile_calls(
        self, functions, tokenizer, *, tool_choice="required", parallel=True, whitespace=None, framing="tool_call"
    ):
        return compile_grammar(
            functions, tokenizer, tool_choice=tool_choice, parallel=parallel, whitespace=whitespace, loosen=self.loosen,
            framing=framing,
        )  # fmt: skip

    def compile_json(self, schema, tokenizer, *, whitespace=None):
        return compile_json_grammar(schema, tokenizer, whitespace=whitespace, loosen=self.loosen)


class GuidanceBackend(GrammarBackend):
    """llguidance's JSON Schema compiler (``compile_guidance_grammar``, ``GuidanceConstraint``)."""

    name = "llguidance"
    grammar_type = GuidanceGrammar
    constraint_type = GuidanceConstraint

    def check_tools(self, functions):
        """Nothing to check early: llguidance judges tool schemas when it compiles them."""

    def compile_calls(
        self, functions, tokenizer, *, tool_choice="required", parallel=True, whitespace=None, framing="tool_call"
    ):
        return compile_guidance_grammar(
            functions, tokenizer, tool_choice=tool_choice, parallel=parallel, whitespace=whitespace, framing=framing
        )

    def compile_json(self, schema, tokenizer, *, whitespace=None):
        return compile_guidance_json_grammar(schema, tokenizer, whitespace=whitespace)


class AutoBackend(GrammarBackend):
    """``outlines`` where our translation enforces every keyword of the turn's schemas exactly, ``llguidance`` where
    it does not (the choice is the cheap schema rewrite, made before anything is compiled); a batch may mix both."""

    name = "auto"
    grammar_type = (CompiledGrammar, GuidanceGrammar)

    def __init__(self, outlines: OutlinesBackend, guidance: GuidanceBackend):
        self.outlines, self.guidance = outlines, guidance

    def choose(self, rewrite: Callable[[], object]) -> GrammarBackend:
        """``outlines`` when ``rewrite`` (our strict schema rewrite) succeeds, ``llguidance`` when it raises
        Unenforceable; GrammarError naming the schema's problem and the package when llguidance is not installed."""
        try:
            rewrite()
        except Unenforceable as exc:
            if importlib.util.find_spec("llguidance") is None:
                raise GrammarError(f"{exc}. grammar_backend 'auto' gives it to llguidance: {INSTALL_HINT}") from None
            return self.guidance
        return self.outlines

    def check_tools(self, functions):
        self.choose(lambda: [call_schema(f) for f in functions])

    def compile_calls(
        self, functions, tokenizer, *, tool_choice="required", parallel=True, whitespace=None, framing="tool_call"
    ):
        backend = self.choose(lambda: [call_schema(f) for f in functions])
        return backend.compile_calls(
            functions, tokenizer, tool_choice=tool_choice, parallel=parallel, whitespace=whitespace, framing=framing
        )

    def compile_json(self, schema, tokenizer, *, whitespace=None):
        backend = self.choose(lambda: enforced_schema(JSON_OBJECT if schema is None else schema, "response_format"))
        return backend.compile_json(schema, tokenizer, whitespace=whitespace)

    def constraint(self, grammars, vocab_size):
        """Each backend's constraint over its rows: one of them alone when the batch is all ours or all llguidance's."""
        parts = []
        for backend in (self.outlines, self.guidance):
            rows = [i for i, g in enumerate(grammars) if isinstance(g, backend.grammar_type)]
            if rows:
                parts.append((rows, backend.constraint([grammars[i] for i in rows], vocab_size)))
        if sum(len(rows) for rows, _ in parts) != len(grammars):
            other = next(g for g in grammars if not isinstance(g, self.grammar_type))
            raise TypeError(f"grammar backend 'auto' cannot decode a {type(other).__name__}")
        return parts[0][1] if len(parts) == 1 else SplitConstraint(parts, len(grammars))


_OUTLINES, _GUIDANCE = OutlinesBackend(), GuidanceBackend()
_AUTO = AutoBackend(_OUTLINES, _GUIDANCE)
BACKENDS: dict[str, GrammarBackend] = {b.name: b for b in (_OUTLINES, OutlinesBackend(loosen=True), _GUIDANCE, _AUTO)}


def grammar_constraint(grammars: Sequence[Grammar], vocab_size: int) -> TokenConstraint:
    """The constraint of rows decoding under ``grammars``, whichever backend compiled each (each backend's
    constraint over its own rows): what code that did not compile the grammars uses (calibration, the harnesses)."""
    return _AUTO.constraint(grammars, vocab_size)


def backend_for(name: str) -> GrammarBackend:
    """The grammar backend called ``name`` (``arguments.GRAMMAR_BACKENDS``); ValueError naming the choices."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar_backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]

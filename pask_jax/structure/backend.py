"""The grammar backends behind one interface, chosen by name in one place (``backend_for``).

A backend compiles a turn's grammar (tool calls, or one JSON value of a response schema) for a tokenizer and gives
the ``TokenConstraint`` that decodes under it; the request side (``RequestBuilder``, ``LLM``) asks nothing else:

- ``"outlines"``: our schema-to-regex translation and outlines-core (``grammar.py``: ``CompiledGrammar``,
  ``constraint.GrammarConstraint``); tool schemas it cannot enforce are refused when the request is parsed;
- ``"llguidance"``: llguidance's JSON Schema compiler (``guidance.py``: ``GuidanceGrammar``, ``GuidanceConstraint``;
  llguidance is imported only when a grammar is compiled); it judges tool schemas when it compiles them.

What both share, and all the request side reads of a compiled grammar, is ``Grammar``: the turn's ``kind``, the
callable ``function_names``, ``parallel``, the ``vocab`` (token bytes, framing ids) and ``compile_s``. A token's role
is the constraint's business under either backend (``TokenConstraint.advance``; both lex the token's bytes with
``lexer.py``), so PASK's roles and its release of unchosen tools do not depend on the backend.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar, Protocol

from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.constraint import GrammarConstraint, RowConstraint
from pask_jax.structure.grammar import CompiledGrammar, compile_grammar, compile_json_grammar
from pask_jax.structure.guidance import (
    GuidanceConstraint,
    GuidanceGrammar,
    compile_guidance_grammar,
    compile_guidance_json_grammar,
)
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

    name: ClassVar[str]
    checks_schemas: ClassVar[bool]  # tool schemas are judged when a request is parsed (else when compiled)
    grammar_type: ClassVar[type]  # what its compiles return
    constraint_type: ClassVar[type[RowConstraint]]

    @abc.abstractmethod
    def compile_calls(
        self,
        functions: Sequence[dict],
        tokenizer: Tokenizer,
        *,
        tool_choice: str = "required",
        parallel: bool = True,
        whitespace: str | None = None,
    ) -> Grammar:
        """Function dicts (``parse_tools``) -> the grammar of a turn that calls them (``"auto"``: or a text answer);
        GrammarError naming the function whose schema cannot be compiled."""

    @abc.abstractmethod
    def compile_json(self, schema: dict | None, tokenizer: Tokenizer, *, whitespace: str | None = None) -> Grammar:
        """The grammar of a ``response_format`` turn: one JSON value of ``schema`` (None: any object)."""

    def constraint(self, grammars: Sequence[Grammar], vocab_size: int) -> RowConstraint:
        """The ``TokenConstraint`` of rows decoding under ``grammars`` (one per row, all compiled by this backend)
        over a model's ``vocab_size`` logits."""
        for g in grammars:
            if not isinstance(g, self.grammar_type):
                raise TypeError(f"grammar backend {self.name!r} cannot decode a {type(g).__name__}")
        return self.constraint_type(list(grammars), vocab_size)


class OutlinesBackend(GrammarBackend):
    """Ours: the schema translation of ``schema.py`` and outlines-core (``compile_grammar``, ``GrammarConstraint``)."""

    name = "outlines"
    checks_schemas = True
    grammar_type = CompiledGrammar
    constraint_type = GrammarConstraint

    def compile_calls(self, functions, tokenizer, *, tool_choice="required", parallel=True, whitespace=None):
        return compile_grammar(functions, tokenizer, tool_choice=tool_choice, parallel=parallel, whitespace=whitespace)

    def compile_json(self, schema, tokenizer, *, whitespace=None):
        return compile_json_grammar(schema, tokenizer, whitespace=whitespace)


class GuidanceBackend(GrammarBackend):
    """llguidance's JSON Schema compiler (``compile_guidance_grammar``, ``GuidanceConstraint``)."""

    name = "llguidance"
    checks_schemas = False
    grammar_type = GuidanceGrammar
    constraint_type = GuidanceConstraint

    def compile_calls(self, functions, tokenizer, *, tool_choice="required", parallel=True, whitespace=None):
        return compile_guidance_grammar(
            functions, tokenizer, tool_choice=tool_choice, parallel=parallel, whitespace=whitespace
        )

    def compile_json(self, schema, tokenizer, *, whitespace=None):
        return compile_guidance_json_grammar(schema, tokenizer, whitespace=whitespace)


BACKENDS: dict[str, GrammarBackend] = {b.name: b for b in (OutlinesBackend(), GuidanceBackend())}


def backend_for(name: str) -> GrammarBackend:
    """The grammar backend called ``name`` (``arguments.GRAMMAR_BACKENDS``); ValueError naming the choices."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar_backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]

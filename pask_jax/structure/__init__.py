"""Structure from the parser: the role taxonomy, the tool-call grammar (outlines-core) and prompt labelling.

- ``roles``: ``Role`` (stable integer ids), ``TAXONOMY_VERSION``, ``PROMPT_ROLES`` / ``GENERATED_ROLES``.
- ``grammar``: BFCL functions -> JSON Schema -> regex -> compiled outlines-core index with a state-transition -> role
  table; ``GrammarConstraint`` is the engine's ``TokenConstraint`` (packed masks in, roles out).
- ``prompt_roles``: the role of every prompt token (chat template, system / user text, the tools JSON lexed).
"""

from pask_jax.structure.grammar import (
    FRAMINGS,
    CompiledGrammar,
    GrammarConstraint,
    GrammarError,
    compile_grammar,
    grammar_vocabulary,
    tool_call_regex,
    tool_schema,
)
from pask_jax.structure.prompt_roles import prompt_roles
from pask_jax.structure.roles import GENERATED_ROLES, PROMPT_ROLES, TAXONOMY_VERSION, Role, num_roles

__all__ = [
    "FRAMINGS",
    "GENERATED_ROLES",
    "PROMPT_ROLES",
    "TAXONOMY_VERSION",
    "CompiledGrammar",
    "GrammarConstraint",
    "GrammarError",
    "Role",
    "compile_grammar",
    "grammar_vocabulary",
    "num_roles",
    "prompt_roles",
    "tool_call_regex",
    "tool_schema",
]

"""The role taxonomy: stable ids, and the prompt / generated partition. (Prompt-token roles: test_prompt_roles.py;
generated-token roles: test_grammar.py.)"""

from __future__ import annotations

from pask_jax import structure
from pask_jax.structure import roles as roles_module
from pask_jax.structure.roles import GENERATED_ROLES, PROMPT_ROLES, TAXONOMY_VERSION, Role, num_roles, role_names


def test_taxonomy_ids_are_stable():
    # Policies are tables indexed by these ids: renumbering one silently breaks every calibrated policy.
    assert TAXONOMY_VERSION == "pask-roles-v1"
    assert role_names() == [
        "TEMPLATE", "SYSTEM_TEXT", "TOOL_NAME", "PARAM_NAME", "SCHEMA_VALUE", "DESCRIPTION", "SCHEMA_PUNCT",
        "USER_TEXT", "STRUCTURAL", "FRAMING", "FUNCTION_NAME", "ARG_KEY", "ARG_STRING", "ARG_NUMBER", "ARG_LITERAL",
        "WHITESPACE", "FREE_TEXT", "END_OF_TURN", "SINK",
    ]  # fmt: skip
    assert [int(r) for r in Role] == list(range(num_roles()))
    assert set(PROMPT_ROLES).isdisjoint(GENERATED_ROLES)
    assert set(PROMPT_ROLES) | set(GENERATED_ROLES) | {Role.SINK} == set(Role)
    assert Role.TEMPLATE == 0  # what a zero-filled role array means
    assert roles_module.Role is Role is structure.Role

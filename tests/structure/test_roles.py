"""The role taxonomy: stable ids, and the prompt / generated partition. (Prompt-token roles: test_prompt_roles.py;
generated-token roles: test_grammar.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from pask_jax import structure
from pask_jax.structure import roles as roles_module
from pask_jax.structure.roles import (
    GENERATED_ROLES,
    PROMPT_ROLES,
    TAXONOMY_VERSION,
    Role,
    num_roles,
    role_names,
    taxonomy_roles,
    upgrade_rows,
)


def test_taxonomy_ids_are_stable():
    # Policies are tables indexed by these ids: renumbering one silently breaks every calibrated policy.
    assert TAXONOMY_VERSION == "pask-roles-v2"
    assert role_names() == [
        "TEMPLATE", "SYSTEM_TEXT", "TOOL_NAME", "PARAM_NAME", "SCHEMA_VALUE", "DESCRIPTION", "SCHEMA_PUNCT",
        "USER_TEXT", "STRUCTURAL", "FRAMING", "FUNCTION_NAME", "ARG_KEY", "ARG_STRING", "ARG_NUMBER", "ARG_LITERAL",
        "WHITESPACE", "FREE_TEXT", "END_OF_TURN", "SINK", "REQUEST_TEXT", "HISTORY_TEXT", "TOOL_RESULT",
    ]  # fmt: skip
    assert [int(r) for r in Role] == list(range(num_roles()))
    assert set(PROMPT_ROLES).isdisjoint(GENERATED_ROLES)
    assert set(PROMPT_ROLES) | set(GENERATED_ROLES) | {Role.SINK} == set(Role)
    assert Role.TEMPLATE == 0  # what a zero-filled role array means
    assert roles_module.Role is Role is structure.Role


def test_a_v1_table_answers_the_v2_roles_with_user_text():
    v1 = np.arange(19 * 2).reshape(19, 2)  # a [R, G] table of the first taxonomy
    v2 = upgrade_rows(v1, "pask-roles-v1")
    assert v2.shape == (num_roles(), 2) and (v2[:19] == v1).all()
    for role in (Role.REQUEST_TEXT, Role.HISTORY_TEXT, Role.TOOL_RESULT):
        assert (v2[role] == v1[Role.USER_TEXT]).all()
    assert upgrade_rows(v2, TAXONOMY_VERSION) is v2
    assert taxonomy_roles("pask-roles-v1") == 19 and taxonomy_roles(TAXONOMY_VERSION) == num_roles()
    with pytest.raises(ValueError, match="19 role rows"):
        upgrade_rows(v1[:18], "pask-roles-v1")
    with pytest.raises(ValueError, match="unknown"):
        taxonomy_roles("pask-roles-v9")

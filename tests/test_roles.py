"""The role taxonomy and the roles of prompt tokens (golden, hand-checked sequences)."""

from __future__ import annotations

import pytest

from pask_jax.bfcl import CATEGORIES, load_category
from pask_jax.models.chat_template import bfcl_prompt, format_tool_prompt
from pask_jax.models.tokenizer import qwen_tokenizer
from pask_jax.structure import roles as roles_module
from pask_jax.structure.prompt_roles import char_roles, prompt_roles
from pask_jax.structure.roles import GENERATED_ROLES, PROMPT_ROLES, TAXONOMY_VERSION, Role, num_roles, role_names

WEATHER = {
    "name": "get_weather",
    "description": "Current weather.",
    "parameters": {
        "type": "dict",
        "properties": {
            "city": {"type": "string", "description": "City name."},
            "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        },
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def runs(tok, text: str, roles: list[int]) -> list[tuple[str, str]]:
    """Consecutive tokens with the same role merged: [(role name, their text)]."""
    out: list[list[str]] = []
    for token, role in zip(tok.encode(text), roles, strict=True):
        name = Role(role).name
        if out and out[-1][0] == name:
            out[-1][1] += tok.decode([token])
        else:
            out.append([name, tok.decode([token])])
    return [tuple(run) for run in out]


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
    assert roles_module.Role is Role


def test_prompt_roles_golden_with_system_message(tok):
    prompt = format_tool_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], [WEATHER]
    )
    roles = prompt_roles(prompt, tok, [WEATHER])
    assert len(roles) == len(tok.encode(prompt))
    header = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        "function signatures within <tools></tools> XML tags:\n<tools>\n"
    )
    footer = (
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n"
    )
    # Hand-checked. Each token takes the role of its first character: ' "' opening a value starts with a space
    # (SCHEMA_PUNCT), '",' closing a name starts with its closing quote (TOOL_NAME).
    assert runs(tok, prompt, roles) == [
        ("SINK", "<|im_start|>"),
        ("TEMPLATE", "system\n"),
        ("SYSTEM_TEXT", "Be brief.\n\n"),
        ("TEMPLATE", header),
        ("SCHEMA_PUNCT", '{"name": "'),
        ("TOOL_NAME", 'get_weather",'),
        ("SCHEMA_PUNCT", ' "description": "'),
        ("DESCRIPTION", 'Current weather.",'),
        ("SCHEMA_PUNCT", ' "parameters": {"type": "'),
        ("SCHEMA_VALUE", 'dict",'),
        ("SCHEMA_PUNCT", ' "properties": {"'),
        ("PARAM_NAME", 'city":'),
        ("SCHEMA_PUNCT", ' {"type": "'),
        ("SCHEMA_VALUE", 'string",'),
        ("SCHEMA_PUNCT", ' "description": "'),
        ("DESCRIPTION", 'City name."'),
        ("SCHEMA_PUNCT", '}, "'),
        ("PARAM_NAME", 'unit":'),
        ("SCHEMA_PUNCT", ' {"type": "'),
        ("SCHEMA_VALUE", 'string",'),
        ("SCHEMA_PUNCT", ' "enum": ["'),
        ("SCHEMA_VALUE", 'c",'),
        ("SCHEMA_PUNCT", ' "'),
        ("SCHEMA_VALUE", 'f"],'),
        ("SCHEMA_PUNCT", ' "default": "'),
        ("SCHEMA_VALUE", 'c"}'),
        ("SCHEMA_PUNCT", '}, "required": ["'),
        ("SCHEMA_VALUE", 'city"]'),
        ("SCHEMA_PUNCT", "}}\n"),
        ("TEMPLATE", footer),
        ("USER_TEXT", "Weather in Paris?"),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>assistant\n"),
    ]


def test_char_roles_golden_bfcl_item():
    # The characters (not tokens) of simple_python_0's tools JSON: exact spans, quotes with their strings.
    item = load_category("simple_python")[0]
    prompt = bfcl_prompt(item)
    roles, names = char_roles(prompt)
    assert names == ["calculate_triangle_area"]

    def role_of(fragment: str, offset: int = 0) -> str:
        return Role(roles[prompt.index(fragment) + offset]).name

    assert role_of('"calculate_triangle_area"') == "TOOL_NAME"
    assert role_of('"calculate_triangle_area"', len('"calculate_triangle_area"') - 1) == "TOOL_NAME"
    assert role_of('"name": ') == "SCHEMA_PUNCT"
    assert role_of('"base": {') == "PARAM_NAME"
    assert role_of('"integer"') == "SCHEMA_VALUE"
    assert role_of('"The base of the triangle."') == "DESCRIPTION"
    assert role_of("Note that the provided function is in Python 3 syntax.") == "DESCRIPTION"
    assert role_of('["base", "height"]', 1) == "SCHEMA_VALUE"
    assert role_of('["base", "height"]') == "SCHEMA_PUNCT"
    assert role_of("Find the area of a triangle") == "USER_TEXT"
    assert role_of("<|im_start|>assistant") == "TEMPLATE"


def test_prompt_roles_cover_every_bfcl_category(tok):
    for category in CATEGORIES:
        for item in load_category(category)[:3]:
            prompt = bfcl_prompt(item)
            roles = prompt_roles(prompt, tok, item["function"])
            assert len(roles) == len(tok.encode(prompt)), item["id"]
            assert roles[0] == Role.SINK
            present = set(roles)
            for role in (Role.TEMPLATE, Role.TOOL_NAME, Role.PARAM_NAME, Role.SCHEMA_VALUE, Role.DESCRIPTION):
                assert role in present, (item["id"], role)
            assert Role.USER_TEXT in present, item["id"]
            # the TOOL_NAME tokens spell each function's name
            named = "".join(
                tok.decode([t]) for t, r in zip(tok.encode(prompt), roles, strict=True) if r == Role.TOOL_NAME
            )
            for function in item["function"]:
                assert function["name"] in named, (item["id"], function["name"])


def test_prompt_roles_without_tools_and_sinks(tok):
    prompt = format_tool_prompt([{"role": "system", "content": "Hi."}, {"role": "user", "content": "Yo"}], [])
    roles = prompt_roles(prompt, tok, sink_tokens=0)
    assert runs(tok, prompt, roles) == [
        ("TEMPLATE", "<|im_start|>system\n"),
        ("SYSTEM_TEXT", "Hi."),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>user\n"),
        ("USER_TEXT", "Yo"),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>assistant\n"),
    ]
    assert prompt_roles(prompt, tok, sink_tokens=4) == [Role.SINK] * 4 + roles[4:]


def test_prompt_roles_checks_the_function_list(tok):
    prompt = format_tool_prompt([{"role": "user", "content": "x"}], [WEATHER])
    with pytest.raises(ValueError, match="get_weather"):
        prompt_roles(prompt, tok, [{**WEATHER, "name": "other"}])

"""Prompt-token roles from character offsets of a rendered prompt: BFCL's fixed prompt and checkpoint templates.

The templates are those of tests/data (see tests/models/test_chat_template.py). BFCL's labels are pinned twice: a
hand-checked golden sequence, and digests of the token roles the earlier tools-block lexer gave the first items of
every category (tests/data/bfcl_prompt_roles_digests.json), which committed results depend on.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from pask_jax.experiments.bfcl import CATEGORIES, load_category
from pask_jax.experiments.bfcl.prompt import bfcl_prompt, bfcl_python_functions, format_tool_prompt
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.models.tokenizer import qwen_tokenizer
from pask_jax.structure.prompt_roles import label_prompt, prompt_roles
from pask_jax.structure.roles import Role

DATA = Path(__file__).parents[1] / "data"
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
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich."}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "description": "IANA zone."}}},
    },
}
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
    {"role": "user", "content": "And the time?"},
]


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def data_template(file: str) -> ChatTemplate:
    return ChatTemplate((DATA / file).read_text(encoding="utf-8"), bos_token="<|begin_of_text|>", name=file)


def token_runs(tok, text: str, roles: list[int]) -> list[tuple[str, str]]:
    """Consecutive tokens with the same role merged: [(role name, their text)]."""
    out: list[list[str]] = []
    for token, role in zip(tok.encode(text), roles, strict=True):
        name = Role(role).name
        if out and out[-1][0] == name:
            out[-1][1] += tok.decode([token])
        else:
            out.append([name, tok.decode([token])])
    return [tuple(run) for run in out]


def char_runs(text: str, roles: np.ndarray) -> list[tuple[str, str]]:
    """Consecutive characters with the same role: [(role name, their text)]."""
    out: list[list[str]] = []
    for char, role in zip(text, roles, strict=True):
        name = Role(int(role)).name
        if out and out[-1][0] == name:
            out[-1][1] += char
        else:
            out.append([name, char])
    return [tuple(run) for run in out]


def test_bfcl_roles_equal_the_recorded_digests(tok):
    recorded = json.loads((DATA / "bfcl_prompt_roles_digests.json").read_text())["items"]
    items = {item["id"]: item for category in CATEGORIES for item in load_category(category)[:3]}
    assert sorted(items) == sorted(recorded)
    for item_id, item in items.items():
        text = bfcl_prompt(item)
        roles = prompt_roles(text, tok, item["question"][0], bfcl_python_functions(item["function"]))
        assert len(roles) == recorded[item_id]["tokens"], item_id
        # recorded under pask-roles-v1: the request, history and tool results were all USER_TEXT
        v1 = [Role.USER_TEXT if r in (Role.REQUEST_TEXT, Role.HISTORY_TEXT, Role.TOOL_RESULT) else r for r in roles]
        digest = hashlib.sha256(",".join(str(int(r)) for r in v1).encode()).hexdigest()
        assert digest == recorded[item_id]["sha256"], item_id


def test_bfcl_prompt_golden_with_system_message(tok):
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Weather in Paris?"}]
    prompt = format_tool_prompt(messages, [WEATHER])
    roles = prompt_roles(prompt, tok, messages, [WEATHER])
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
    # (SCHEMA_PUNCT), '",' closing a name starts with its closing quote (TOOL_NAME). The "\n\n" after the system text
    # is its own token and belongs to the system message.
    assert token_runs(tok, prompt, roles) == [
        ("SINK", "<|im_start|>"),
        ("TEMPLATE", "system\n"),
        ("SYSTEM_TEXT", "Be brief\n\n"),
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
        ("REQUEST_TEXT", "Weather in Paris?"),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>assistant\n"),
    ]


def test_bfcl_prompt_without_tools_and_sinks(tok):
    messages = [{"role": "system", "content": "Hi."}, {"role": "user", "content": "Yo"}]
    prompt = format_tool_prompt(messages, [])
    roles = prompt_roles(prompt, tok, messages, sink_tokens=0)
    assert token_runs(tok, prompt, roles) == [
        ("TEMPLATE", "<|im_start|>system\n"),
        ("SYSTEM_TEXT", "Hi."),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>user\n"),
        ("REQUEST_TEXT", "Yo"),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>assistant\n"),
    ]
    assert prompt_roles(prompt, tok, messages, sink_tokens=4) == [Role.SINK] * 4 + roles[4:]


def test_qwen_template_conversation_golden():
    text = data_template("qwen2.5_instruct.jinja").render(CONVERSATION, [WEATHER_TOOL, TIME_TOOL])
    labels = label_prompt(text, CONVERSATION, [WEATHER_TOOL, TIME_TOOL])
    assert labels.tool_names == ["get_weather", "get_time"]
    runs = char_runs(text, labels.roles)
    tools_json = [
        ("SCHEMA_PUNCT", '\n{"type": '),
        ("SCHEMA_VALUE", '"function"'),
        ("SCHEMA_PUNCT", ', "function": {"name": '),
        ("TOOL_NAME", '"get_weather"'),
        ("SCHEMA_PUNCT", ', "description": '),
        ("DESCRIPTION", '"Current weather in a city."'),
        ("SCHEMA_PUNCT", ', "parameters": {"type": '),
        ("SCHEMA_VALUE", '"object"'),
        ("SCHEMA_PUNCT", ', "properties": {'),
        ("PARAM_NAME", '"city"'),
        ("SCHEMA_PUNCT", ': {"type": '),
        ("SCHEMA_VALUE", '"string"'),
        ("SCHEMA_PUNCT", ', "description": '),
        ("DESCRIPTION", '"City name, e.g. Zürich."'),
        ("SCHEMA_PUNCT", '}}, "required": ['),
        ("SCHEMA_VALUE", '"city"'),
        ("SCHEMA_PUNCT", ']}}}\n{"type": '),
        ("SCHEMA_VALUE", '"function"'),
        ("SCHEMA_PUNCT", ', "function": {"name": '),
        ("TOOL_NAME", '"get_time"'),
        ("SCHEMA_PUNCT", ', "description": '),
        ("DESCRIPTION", '"Local time."'),
        ("SCHEMA_PUNCT", ', "parameters": {"type": '),
        ("SCHEMA_VALUE", '"object"'),
        ("SCHEMA_PUNCT", ', "properties": {'),
        ("PARAM_NAME", '"zone"'),
        ("SCHEMA_PUNCT", ': {"type": '),
        ("SCHEMA_VALUE", '"string"'),
        ("SCHEMA_PUNCT", ', "description": '),
        ("DESCRIPTION", '"IANA zone."'),
        ("SCHEMA_PUNCT", "}}}}}"),
    ]
    assert runs[0] == ("TEMPLATE", "<|im_start|>system\n")
    assert runs[1] == ("SYSTEM_TEXT", "Answer briefly.\n\n")
    assert runs[2][0] == "TEMPLATE" and runs[2][1].startswith("# Tools") and runs[2][1].endswith("<tools>")
    assert runs[3 : 3 + len(tools_json)] == tools_json
    rest = runs[3 + len(tools_json) :]
    assert rest[0][0] == "TEMPLATE" and rest[0][1].startswith("\n</tools>\n\nFor each function call")
    assert rest[1:] == [
        ("HISTORY_TEXT", "Weather in Zürich?"),
        ("TEMPLATE", '<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "'),
        ("FREE_TEXT", "get_weather"),
        ("TEMPLATE", '", "arguments": '),
        ("FREE_TEXT", '{"city": "Zürich"}'),
        ("TEMPLATE", "}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"),
        ("TOOL_RESULT", '{"temp": 21}\n'),
        ("TEMPLATE", "</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        ("FREE_TEXT", "It is 21 degrees."),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>user\n"),
        ("REQUEST_TEXT", "And the time?"),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>assistant\n"),
    ]


def role_at(text: str, roles: np.ndarray, fragment: str, start: int = 0) -> set[str]:
    """The roles of every character of the first ``fragment`` at or after ``start``."""
    at = text.index(fragment, start)
    return {Role(int(r)).name for r in roles[at : at + len(fragment)]}


def test_llama_style_conversation_roles(tok):
    # Tools pretty-printed (indent=4) into the first user turn, texts trimmed, the tool result JSON-encoded.
    messages = copy.deepcopy(CONVERSATION)
    messages[1]["content"] = "  Weather in Zürich?\n"  # the template trims it
    tools = [WEATHER_TOOL, TIME_TOOL]
    text = data_template("llama3.1_style.jinja").render(messages, tools)
    roles = label_prompt(text, messages, tools).roles
    assert '{\n    "type": "function",\n    "function": {\n        "name": "get_weather"' in text
    tools_at = text.index('{\n    "type"')
    assert role_at(text, roles, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>") == {"TEMPLATE"}
    assert role_at(text, roles, "Given the following functions") == {"TEMPLATE"}
    assert role_at(text, roles, "<|eot_id|><|start_header_id|>assistant<|end_header_id|>") == {"TEMPLATE"}
    assert role_at(text, roles, "Answer briefly.") == {"SYSTEM_TEXT"}
    assert role_at(text, roles, '"get_weather"', tools_at) == {"TOOL_NAME"}
    assert role_at(text, roles, '"get_time"', tools_at) == {"TOOL_NAME"}
    assert role_at(text, roles, '"city"', tools_at) == {"PARAM_NAME"}
    assert role_at(text, roles, '"zone"', tools_at) == {"PARAM_NAME"}
    assert role_at(text, roles, '"City name, e.g. Zürich."') == {"DESCRIPTION"}
    assert role_at(text, roles, '"Local time."') == {"DESCRIPTION"}
    assert role_at(text, roles, '"object"', tools_at) == {"SCHEMA_VALUE"}
    assert role_at(text, roles, '\n        "parameters": {\n', tools_at) == {"SCHEMA_PUNCT"}
    assert role_at(text, roles, "Weather in Zürich?") == {"HISTORY_TEXT"}
    assert role_at(text, roles, '{"name": "get_weather", "parameters": ') - {"FREE_TEXT"} == {"TEMPLATE"}
    assert role_at(text, roles, '{"city": "Zürich"}}') == {"FREE_TEXT", "TEMPLATE"}
    assert role_at(text, roles, json.dumps('{"temp": 21}')) == {"TOOL_RESULT"}
    assert role_at(text, roles, "It is 21 degrees.") == {"FREE_TEXT"}
    assert role_at(text, roles, "And the time?") == {"REQUEST_TEXT"}
    token_roles = prompt_roles(text, tok, messages, tools)
    assert len(token_roles) == len(tok.encode(text)) and token_roles[0] == Role.SINK
    assert {Role.TOOL_NAME, Role.PARAM_NAME, Role.DESCRIPTION, Role.REQUEST_TEXT, Role.TEMPLATE} <= set(token_roles)


def test_smollm2_conversation_roles():
    # ChatML without tools; its default system message (none given) is the template's own text.
    messages = [
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    template = data_template("smollm2_instruct.jinja")
    text = template.render(messages)
    assert char_runs(text, label_prompt(text, messages).roles) == [
        (
            "TEMPLATE",
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\n",
        ),
        ("HISTORY_TEXT", "Hi there."),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>assistant\n"),
        ("FREE_TEXT", "Hello!"),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>user\n"),
        ("REQUEST_TEXT", "Tell me a joke."),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>assistant\n"),
    ]
    with_system = [{"role": "system", "content": "Be terse."}, *messages]
    text = template.render(with_system)
    assert char_runs(text, label_prompt(text, with_system).roles)[:3] == [
        ("TEMPLATE", "<|im_start|>system\n"),
        ("SYSTEM_TEXT", "Be terse."),
        ("TEMPLATE", "<|im_end|>\n<|im_start|>user\n"),
    ]


def test_tools_in_other_layouts_are_found():
    messages = [{"role": "user", "content": "Weather in the city?"}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    layouts = {  # layout: (template body for one tool, where its parameters start)
        "sorted JSON": ("{{ tool | tojson(indent=2, sort_keys=True) }}", '"properties"'),  # found around the name
        "Python repr": ("{{ tool | string }}", "'properties'"),  # not JSON: field by field
        "XML": (
            "<function><name>{{ tool.function.name }}</name><description>{{ tool.function.description }}</description>"
            "{% for k, v in tool.function.parameters.properties | items %}<param><name>{{ k }}</name><description>"
            "{{ v.description }}</description></param>{% endfor %}</function>",
            "<param>",
        ),
    }
    for layout, (body, params) in layouts.items():
        source = "Tools:\n{% for tool in tools %}" + body + "\n{% endfor %}"
        source += "{% for m in messages %}{{ m.content }}{% endfor %}"
        text = ChatTemplate(source).render(messages, tools)
        roles = label_prompt(text, messages, tools).roles
        assert role_at(text, roles, "Tools:") == {"TEMPLATE"}, layout
        assert role_at(text, roles, "get_weather") == {"TOOL_NAME"}, layout
        assert role_at(text, roles, "get_time") == {"TOOL_NAME"}, layout
        assert role_at(text, roles, "Current weather in a city.") == {"DESCRIPTION"}, layout
        assert role_at(text, roles, "IANA zone.") == {"DESCRIPTION"}, layout
        assert role_at(text, roles, "city", text.index(params)) == {"PARAM_NAME"}, layout
        assert role_at(text, roles, "zone", text.index(params, text.index("get_time"))) == {"PARAM_NAME"}, layout
        assert role_at(text, roles, "Weather in the city?") == {"REQUEST_TEXT"}, layout


def test_located_contents_are_checked():
    template = data_template("qwen2.5_instruct.jinja")
    text = template.render(CONVERSATION, [WEATHER_TOOL])
    other = copy.deepcopy(CONVERSATION)
    other[4]["content"] = "Something it never said."
    with pytest.raises(ValueError, match="message 4 .assistant."):
        label_prompt(text, other, [WEATHER_TOOL])
    with pytest.raises(ValueError, match="message 1 .user."):  # out of order: contents are located in order
        label_prompt(text, [CONVERSATION[5], CONVERSATION[1]], [WEATHER_TOOL])
    missing = {"type": "function", "function": {**WEATHER_TOOL["function"], "name": "get_forecast"}}
    with pytest.raises(ValueError, match="tool 1 .'get_forecast'."):
        label_prompt(text, CONVERSATION, [WEATHER_TOOL, missing])
    with pytest.raises(ValueError, match="tool 0"):
        label_prompt(text, CONVERSATION, [{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(ValueError, match="message 0: role 'narrator'"):
        label_prompt(text, [{"role": "narrator", "content": "x"}])


def test_a_template_that_ignores_tools_is_an_error():
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = data_template("smollm2_instruct.jinja").render(messages, [WEATHER_TOOL])
    assert "get_weather" not in text
    with pytest.raises(ValueError, match="tool 0 .'get_weather'. is not in the rendered prompt"):
        label_prompt(text, messages, [WEATHER_TOOL])


def test_bfcl_items_label_every_prompt_role(tok):
    for category in CATEGORIES:
        for item in load_category(category)[:2]:
            text = bfcl_prompt(item)
            roles = prompt_roles(text, tok, item["question"][0], bfcl_python_functions(item["function"]))
            assert {Role.TEMPLATE, Role.TOOL_NAME, Role.PARAM_NAME, Role.SCHEMA_VALUE} <= set(roles), item["id"]
            assert {Role.DESCRIPTION, Role.SCHEMA_PUNCT, Role.REQUEST_TEXT} <= set(roles), item["id"]
            named = "".join(
                tok.decode([t]) for t, r in zip(tok.encode(text), roles, strict=True) if r == Role.TOOL_NAME
            )
            for function in item["function"]:
                assert function["name"] in named, (item["id"], function["name"])

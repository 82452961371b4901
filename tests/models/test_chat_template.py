"""Tests for pask_jax.models.chat_template: BFCL's fixed prompt and checkpoints' own chat templates.

BFCL's prompt equals its Qwen FC handler's, byte for byte. The handler module cannot be imported here (it pulls openai,
overrides, tree_sitter...), so its ``_format_prompt`` is lifted out of the source with ``ast`` and run on its own: it
only needs ``json``. Those tests need ``bfcl-eval`` installed; a hand-checked golden prompt covers the format without
it.

Checkpoint templates (tests/data): ``qwen2.5_instruct.jinja`` is the template embedded in the default model's GGUF
(Qwen2.5-Coder-0.5B-Instruct, the same text as Qwen2.5-Instruct's); ``smollm2_instruct.jinja`` is SmolLM2-Instruct's
ChatML template, written from memory (it ignores tools); ``llama3.1_style.jinja`` is our own template in the style of
Llama 3.1's (tools pretty-printed into the first user turn, JSON calls, ipython results). Rendering is checked
against transformers' own ``render_jinja_template``.
"""

from __future__ import annotations

import ast
import copy
import importlib.resources
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pask_jax.experiments.bfcl import CATEGORIES, load_category
from pask_jax.experiments.bfcl.prompt import bfcl_prompt, bfcl_python_functions, format_tool_call, format_tool_prompt
from pask_jax.models.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

needs_bfcl = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval is not installed")

SIMPLE_PYTHON_0 = {
    "id": "simple_python_0",
    "question": [
        [{"role": "user", "content": "Find the area of a triangle with a base of 10 units and height of 5 units."}]
    ],
    "function": [
        {
            "name": "calculate_triangle_area",
            "description": "Calculate the area of a triangle given its base and height.",
            "parameters": {
                "type": "dict",
                "properties": {
                    "base": {"type": "integer", "description": "The base of the triangle."},
                    "height": {"type": "integer", "description": "The height of the triangle."},
                    "unit": {
                        "type": "string",
                        "description": "The unit of measure (defaults to 'units' if not specified)",
                    },
                },
                "required": ["base", "height"],
            },
        }
    ],
}
SIMPLE_PYTHON_0_PROMPT = (
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"name": "calculate_triangle_area", "description": "Calculate the area of a triangle given its base and height. '
    'Note that the provided function is in Python 3 syntax.", "parameters": {"type": "dict", "properties": {"base": '
    '{"type": "integer", "description": "The base of the triangle."}, "height": {"type": "integer", "description": '
    '"The height of the triangle."}, "unit": {"type": "string", "description": "The unit of measure (defaults to '
    '\'units\' if not specified)"}}, "required": ["base", "height"]}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nFind the area of a triangle with a base of 10 units and height of 5 units.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def handler_format_prompt() -> Callable[[list[dict], list[dict]], str]:
    """QwenFCHandler._format_prompt(messages, functions), compiled from the installed handler's source."""
    source = importlib.resources.files("bfcl_eval").joinpath("model_handler/local_inference/qwen_fc.py").read_text()
    handler = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "QwenFCHandler")
    method = next(n for n in handler.body if isinstance(n, ast.FunctionDef) and n.name == "_format_prompt")
    method.decorator_list = []  # @override
    namespace: dict = {"json": json}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "qwen_fc.py", "exec"), namespace)
    return lambda messages, functions: namespace["_format_prompt"](None, messages, functions)


def load_items(category: str) -> list[dict]:
    path = importlib.resources.files("bfcl_eval").joinpath(f"data/BFCL_v4_{category}.json")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_golden_prompt():
    item = copy.deepcopy(SIMPLE_PYTHON_0)
    assert bfcl_prompt(item) == SIMPLE_PYTHON_0_PROMPT
    assert item == SIMPLE_PYTHON_0  # the item's functions are copied, not edited


@needs_bfcl
@pytest.mark.parametrize("category", CATEGORIES)
def test_every_item_matches_handler(category, handler_format_prompt):
    from bfcl_eval.utils import _func_doc_language_specific_pre_processing

    for item in load_items(category):
        functions = _func_doc_language_specific_pre_processing(copy.deepcopy(item["function"]), category)
        assert bfcl_python_functions(item["function"]) == functions, item["id"]
        assert bfcl_prompt(item) == handler_format_prompt(item["question"][0], functions), item["id"]


@needs_bfcl
def test_golden_prompt_is_the_handlers(handler_format_prompt):
    assert load_items("simple_python")[0] == SIMPLE_PYTHON_0
    functions = bfcl_python_functions(SIMPLE_PYTHON_0["function"])
    assert handler_format_prompt(SIMPLE_PYTHON_0["question"][0], functions) == SIMPLE_PYTHON_0_PROMPT


@needs_bfcl
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}, {"role": "user", "content": "b"}],
    ],
)
@pytest.mark.parametrize("tools", [[], SIMPLE_PYTHON_0["function"]])
def test_system_message_handling_matches_handler(messages, tools, handler_format_prompt):
    assert format_tool_prompt(messages, tools) == handler_format_prompt(messages, tools)


@needs_bfcl
def test_tool_call_as_handler_renders_it(handler_format_prompt):
    arguments = {"base": 10, "height": 5, "unit": "units", "tags": ["a", "é"], "nested": {"x": 1.5, "y": None}}
    call = format_tool_call("calculate_triangle_area", arguments)
    past_turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "calculate_triangle_area", "arguments": arguments}],
    }
    messages = [{"role": "user", "content": "q1"}, past_turn, {"role": "user", "content": "q2"}]
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n" in handler_format_prompt(messages, [])


def test_tool_call_parses_as_the_handler_parses():
    arguments = {"number": 5, "mode": "exact", "values": [1, 2.5]}
    call = format_tool_call("math.factorial", arguments)
    expected = '{"name": "math.factorial", "arguments": {"number": 5, "mode": "exact", "values": [1, 2.5]}}'
    assert call == f"<tool_call>\n{expected}\n</tool_call>"
    bodies = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", call, re.DOTALL)  # QwenFCHandler._extract_tool_calls
    assert [json.loads(body) for body in bodies] == [{"name": "math.factorial", "arguments": arguments}]


def test_only_system_and_user_roles():
    with pytest.raises(ValueError, match="'assistant'"):
        format_tool_prompt([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], [])


DATA = Path(__file__).parents[1] / "data"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich."},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
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
    {"role": "user", "content": "Thanks!"},
]
CHAT = [
    {"role": "user", "content": "Hi there."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
]


def data_template(file: str, **special: str) -> ChatTemplate:
    return ChatTemplate((DATA / file).read_text(encoding="utf-8"), name=file, **special)


def transformers_render(template: ChatTemplate, messages: list[dict], tools: list[dict] | None) -> str:
    """transformers' own rendering, given what its users pass: arguments as dicts, no None-valued keys."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    conversation = copy.deepcopy(messages)
    for message in conversation:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    conversation = [{k: v for k, v in m.items() if v is not None} for m in conversation]
    special = {k: v for k, v in (("bos_token", template.bos_token), ("eos_token", template.eos_token)) if v}
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[conversation], tools=tools, chat_template=template.source, add_generation_prompt=True, **special
    )
    return rendered[0]


@pytest.mark.parametrize(
    ("file", "messages", "tools"),
    [
        ("qwen2.5_instruct.jinja", CONVERSATION, [WEATHER_TOOL]),
        ("qwen2.5_instruct.jinja", CHAT, None),
        ("llama3.1_style.jinja", CONVERSATION, [WEATHER_TOOL]),
        ("llama3.1_style.jinja", CHAT, None),
        ("smollm2_instruct.jinja", CHAT, None),
        ("smollm2_instruct.jinja", [{"role": "system", "content": "Be terse."}, *CHAT], None),
    ],
)
def test_render_matches_transformers(file, messages, tools):
    template = data_template(file, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    before = copy.deepcopy(messages)
    assert template.render(messages, tools) == transformers_render(template, messages, tools)
    assert messages == before  # the caller's messages are not edited (arguments stay strings)


def test_qwen_render_golden():
    text = data_template("qwen2.5_instruct.jinja").render(CONVERSATION, [WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n")
    # tojson keeps non-ASCII as is; the OpenAI arguments string is written as the JSON object it holds
    assert '\n{"type": "function", "function": {"name": "get_weather", "description": "Current weather' in text
    assert '"City name, e.g. Zürich."' in text
    assert text.endswith(
        '<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\nIt is 21 degrees.<|im_end|>\n<|im_start|>user\nThanks!"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not data_template("qwen2.5_instruct.jinja").render(CHAT, add_generation_prompt=False).endswith("assistant\n")


@needs_bfcl
@pytest.mark.parametrize("category", CATEGORIES)
def test_qwen_template_and_bfcl_prompt_differ_only_as_documented(category):
    # BFCL's handler is a hand copy of this template. Given BFCL's bare function dicts, they coincide except that
    # (1) the template writes its default system message when there is none, (2) tojson keeps non-ASCII characters
    # that json.dumps escapes. With OpenAI tool dicts the template also writes the {"type": "function", ...} envelope.
    template = data_template("qwen2.5_instruct.jinja")
    for item in load_category(category):
        messages, functions = item["question"][0], bfcl_python_functions(item["function"])
        expected = bfcl_prompt(item)
        if messages[0]["role"] != "system":
            expected = expected.replace("<|im_start|>system\n", f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}\n\n", 1)
        for function in functions:
            expected = expected.replace(json.dumps(function), json.dumps(function, ensure_ascii=False), 1)
        assert template.render(messages, functions) == expected, item["id"]


def test_template_features():
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% if loop.index == 1 %}{% continue %}{% endif %}!{% endfor %}"
        "|{{ ns.n }}|{{ tools | tojson(indent=1, sort_keys=True) }}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') }}"
    )
    text = ChatTemplate(source).render([{"role": "user", "content": "é"}, {"role": "user", "content": "b"}], [{"b": 1}])
    assert text.split("|")[:4] == ["éb!", "2", '[\n {\n  "b": 1\n }\n]', '{"a": 1}']
    assert re.fullmatch(r"\d{4}", text.split("|")[4])


def test_template_errors_are_value_errors():
    llama = data_template("llama3.1_style.jinja")
    with pytest.raises(ChatTemplateError, match="first user message"):  # the template's raise_exception
        llama.render([{"role": "assistant", "content": "a"}], [WEATHER_TOOL])
    with pytest.raises(ChatTemplateError, match="content"):  # SmolLM2's template cannot write a tool call
        data_template("smollm2_instruct.jinja").render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="broken"):
        ChatTemplate("{% if %}", name="broken").render(CHAT)
    with pytest.raises(ChatTemplateError, match="namespace"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(CHAT)
    assert issubclass(ChatTemplateError, ValueError)


def test_bad_messages_and_tools():
    template = data_template("qwen2.5_instruct.jinja")
    bad_call = copy.deepcopy(CONVERSATION)
    bad_call[2]["tool_calls"][0]["function"]["arguments"] = "{city: Zürich}"
    with pytest.raises(ValueError, match="message 2: tool call 0"):
        template.render(bad_call, [WEATHER_TOOL])
    bad_call[2]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(ValueError, match="not a JSON object"):
        template.render(bad_call, [WEATHER_TOOL])
    with pytest.raises(ValueError, match="message 1"):
        template.render([CHAT[0], {"content": "no role"}])
    with pytest.raises(ValueError, match="tool 0"):
        template.render(CHAT, ["get_weather"])


def test_load_from_hf_directory(tmp_path):
    assert load_chat_template(tmp_path) is None  # no template shipped
    config = {
        "chat_template": "A{{ bos_token }}",
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(tmp_path)
    assert template == ChatTemplate(
        "A{{ bos_token }}", bos_token="<s>", eos_token="</s>", name=f"{tmp_path.name}:default"
    )
    assert template.render(CHAT) == "A<s>"
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert load_chat_template(tmp_path).eos_token == "<|im_end|>"  # the map wins, as in transformers
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).source == "T"  # no "default": the first
    assert load_chat_template(tmp_path, name="rag").source == "R"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path).source == "J"  # the saved file is the default
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "rag.jinja").write_text("R2")
    assert load_chat_template(tmp_path, name="rag").source == "R2"
    with pytest.raises(ValueError, match="no chat template named 'nope'.*tool_use"):
        load_chat_template(tmp_path, name="nope")


def test_load_from_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["<s>", "</s>", "a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template(
        [{"name": "default", "template": "D{{ bos_token }}"}, {"name": "tool_use", "template": "T"}]
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    template = load_chat_template(path)
    assert template == ChatTemplate("D{{ bos_token }}", bos_token="<s>", eos_token="</s>", name="tiny.gguf:default")
    assert load_chat_template(path, name="tool_use").source == "T"
    with pytest.raises(FileNotFoundError):
        load_chat_template(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="weights.bin"):
        load_chat_template(tmp_path / "weights.bin")


def test_default_model_ships_the_qwen_template():
    from pask_jax.models.fetch import cache_dir

    path = cache_dir() / "models" / "qwen2.5-coder-0.5b.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is not fetched")
    template = load_chat_template(path)
    assert template.source == (DATA / "qwen2.5_instruct.jinja").read_text(encoding="utf-8")
    assert (template.bos_token, template.eos_token) == ("<|endoftext|>", "<|im_end|>")

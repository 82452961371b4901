"""Tests for pask_jax.models.chat_template: our prompts equal BFCL's Qwen FC handler's, byte for byte.

The handler module cannot be imported here (it pulls openai, overrides, tree_sitter...), so its ``_format_prompt`` is
lifted out of the source with ``ast`` and run on its own: it only needs ``json``. Those tests need ``bfcl-eval``
installed; a hand-checked golden prompt covers the format without it.
"""

from __future__ import annotations

import ast
import copy
import importlib.resources
import importlib.util
import json
import re
from collections.abc import Callable

import pytest

from pask_jax.bfcl import CATEGORIES
from pask_jax.models.chat_template import bfcl_prompt, bfcl_python_functions, format_tool_call, format_tool_prompt

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

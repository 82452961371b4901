"""The Qwen function-calling prompt, exactly as BFCL's Qwen FC handler writes it.

Scores are only comparable with BFCL's if the model sees the same prompt, so this reproduces
``bfcl_eval/model_handler/local_inference/qwen_fc.py`` (``QwenFCHandler._format_prompt``, a hand-written rendering of
Qwen's chat template) rather than a chat template of our own. Two details of the handler matter:

- tools are written with ``json.dumps`` defaults (``", "``/``": "`` separators, non-ASCII escaped as ``\\uXXXX``),
  one per line inside ``<tools></tools>``, each the BFCL function dict itself (name, description, parameters);
- before that, BFCL's ``load_dataset_entry`` appends a language hint to every function description
  (``_func_doc_language_specific_pre_processing``). All eight categories we evaluate are Python ones, for which that
  is the only change: parameter types (``"dict"``, ``"float"``, ...) are left as they are. ``bfcl_python_functions``
  does this, and ``bfcl_prompt`` chains both for one BFCL item.

Only system and user messages are supported: BFCL's single-turn categories have no others (the handler's assistant and
tool branches serve multi-turn runs, which we do not evaluate).
"""

from __future__ import annotations

import copy
import json
from typing import Any

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
GENERATION_PROMPT = "<|im_start|>assistant\n"
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


def format_tool_prompt(messages: list[dict[str, str]], tools: list[dict[str, Any]]) -> str:
    """[{"role": "system" | "user", "content": str}, ...] + tool dicts -> the prompt, ending in the assistant turn.

    With tools, a leading system message is folded into the tools system block (its content, a blank line, then the
    tools); without tools it stands alone. Later system messages and user messages become their own turns.
    """
    prompt = ""
    has_system = bool(messages) and messages[0]["role"] == "system"
    if tools:
        prompt += "<|im_start|>system\n"
        if has_system:
            prompt += messages[0]["content"] + "\n\n"
        prompt += TOOLS_HEADER + "".join(f"\n{json.dumps(tool)}" for tool in tools) + TOOLS_FOOTER
    elif has_system:
        prompt += f"<|im_start|>system\n{messages[0]['content']}<|im_end|>\n"
    for index, message in enumerate(messages):
        role = message["role"]
        if role not in ("system", "user"):
            raise ValueError(f"message {index} has role {role!r}; only 'system' and 'user' are supported")
        if role == "user" or index > 0:
            prompt += f"<|im_start|>{role}\n{message['content']}<|im_end|>\n"
    return prompt + GENERATION_PROMPT


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    Rendered as the handler renders a past call (``json.dumps`` defaults); its parser accepts any valid JSON here.
    """
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def bfcl_python_functions(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL's preprocessing of a Python-category item's functions: the Python hint appended to each description.

    Returns copies; the item's own dicts are left untouched.
    """
    functions = copy.deepcopy(functions)
    for function in functions:
        function["description"] += PYTHON_HINT
    return functions


def bfcl_prompt(item: dict[str, Any]) -> str:
    """A single-turn BFCL item ({"id", "question": [[messages]], "function": [...]}) -> its Qwen FC prompt."""
    return format_tool_prompt(item["question"][0], bfcl_python_functions(item["function"]))

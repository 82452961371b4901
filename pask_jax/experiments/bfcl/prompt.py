"""BFCL's prompt, and BFCL items as prepared requests and as OpenAI request bodies.

**BFCL's prompt.** Scores are only comparable with BFCL's if the model sees the same prompt, so ``format_tool_prompt``
reproduces ``bfcl_eval/model_handler/local_inference/qwen_fc.py`` (``QwenFCHandler._format_prompt``, BFCL's hand
copy of Qwen's chat template) rather than rendering the checkpoint's template. It differs from Qwen2.5's own template
in three ways: no default system message (Qwen's template writes "You are Qwen, created by Alibaba Cloud. ..." when
the conversation has none), tools written as the bare BFCL function dicts (not OpenAI tool dicts), and ``json.dumps``
defaults (non-ASCII escaped as ``\\uXXXX``; ``tojson`` writes it as is). Two details of the handler matter:

- tools are written with ``json.dumps`` defaults (``", "``/``": "`` separators, non-ASCII escaped as ``\\uXXXX``),
  one per line inside ``<tools></tools>``, each the BFCL function dict itself (name, description, parameters);
- before that, BFCL's ``load_dataset_entry`` appends a language hint to every function description
  (``_func_doc_language_specific_pre_processing``). All eight categories we evaluate are Python ones, for which that
  is the only change: parameter types (``"dict"``, ``"float"``, ...) are left as they are. ``bfcl_python_functions``
  does this, and ``bfcl_prompt`` chains both for one BFCL item.

Only system and user messages are supported there: BFCL's single-turn categories have no others (the handler's
assistant and tool branches serve multi-turn runs, which we do not evaluate).

`prepare_bfcl` / `prepare_tool_prompt` turn an item (or other BFCL-dialect tools in the same prompt) into the
library's `PreparedRequest`, with the grammar over the translated functions; `bfcl_request_body` writes an item as a
user would send it to `pask-jax run` (the checkpoint's own template, OpenAI tools).

**Prompt framings** (`PROMPTS`; for the parallel categories, where BFCL's own prompt gets one call from Qwen2.5
models where two or more are asked): ``bfcl`` is BFCL's prompt; ``bfcl_parallel`` the same with
`PARALLEL_INSTRUCTION` first in the system block (before a system message the item has); ``template`` the
checkpoint's own chat template with OpenAI tools, as `pask-jax run` renders `bfcl_request_body`. The grammar admits
one or more calls under each.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from pask_jax.experiments.bfcl.dialect import bfcl_function
from pask_jax.requests import DEFAULT_MAX_TOKENS, ChatRequest, PreparedRequest, RequestBuilder, parse_request
from pask_jax.structure.prompt_roles import token_labels

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
PROMPTS = ("bfcl", "bfcl_parallel", "template")
PARALLEL_INSTRUCTION = (
    "When the user asks for several things, or for the same thing with several values, make one function call for "
    "each of them: write each call in its own <tool_call></tool_call> block, one after another, and end your turn "
    "only when every call is written."
)


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


def with_parallel_instruction(messages: Sequence[dict]) -> list[dict]:
    """`PARALLEL_INSTRUCTION` as the system message, or before the item's own system message (a blank line apart)."""
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{PARALLEL_INSTRUCTION}\n\n{messages[0]['content']}"
        return messages
    return [{"role": "system", "content": PARALLEL_INSTRUCTION}, *messages]


def bfcl_request_body(item: dict, max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
    """A BFCL item as a user would send it: its first turn's messages and its functions as OpenAI tools (with BFCL's
    Python hint in each description), a call required, greedy."""
    tools = [{"type": "function", "function": bfcl_function(f)} for f in bfcl_python_functions(item["function"])]
    return {
        "messages": item["question"][0],
        "tools": tools,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def prepare_tool_prompt(
    builder: RequestBuilder,
    messages: Sequence[dict],
    functions: Sequence[dict],
    *,
    grammar_functions: Sequence[dict] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    framing: str = "tool_call",
) -> PreparedRequest:
    """BFCL's fixed Qwen FC prompt (parity with its handler) over BFCL-dialect `functions`; calls required.

    `grammar_functions` (default: `functions`) are the tools the grammar allows, e.g. an item's own among
    distractors listed in the prompt."""
    text = format_tool_prompt(list(messages), list(functions))
    ids = builder.tokenizer.encode(text)
    builder.check_length(ids, max_tokens)
    labels = token_labels(text, builder.tokenizer, list(messages), list(functions))
    tools = tuple(bfcl_function(f) for f in (functions if grammar_functions is None else grammar_functions))
    request = ChatRequest(
        messages=tuple(messages), tools=tools, tool_choice="required", max_tokens=max_tokens, temperature=0.0
    )
    grammar = builder.backend.compile_calls(list(tools), builder.tokenizer, tool_choice="required", framing=framing)
    return PreparedRequest.labelled(request, text, ids, labels, grammar)


def prepare_bfcl(
    builder: RequestBuilder,
    item: dict,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    framing: str = "tool_call",
    prompt: str = "bfcl",
) -> PreparedRequest:
    """A BFCL item ({"id", "question": [[messages]], "function": [...]}) under one of `PROMPTS` (default: as BFCL's
    Qwen FC handler prompts it). ``template`` needs the builder's chat template and the ``tool_call`` framing."""
    if prompt not in PROMPTS:
        raise ValueError(f"prompt={prompt!r}; choose one of {', '.join(PROMPTS)}")
    if prompt == "template":
        if framing != "tool_call":
            raise ValueError(f"prompt 'template' writes calls in the template's own syntax, not framing {framing!r}")
        return builder.prepare(parse_request(bfcl_request_body(item, max_tokens)))
    messages = item["question"][0]
    if prompt == "bfcl_parallel":
        messages = with_parallel_instruction(messages)
    functions = bfcl_python_functions(item["function"])
    return prepare_tool_prompt(builder, messages, functions, max_tokens=max_tokens, framing=framing)

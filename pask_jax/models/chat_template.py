"""Chat templates: a checkpoint's own (jinja, as transformers renders it) and BFCL's fixed Qwen FC prompt.

**A checkpoint's template.** ``load_chat_template`` reads the jinja source an HF checkpoint directory or a GGUF file
ships, and ``ChatTemplate.render`` renders OpenAI-style messages and tools with it under the semantics of
transformers' ``apply_chat_template`` (``transformers.utils.chat_template_utils``): an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` / ``lstrip_blocks`` and the loop-control extension; ``tojson`` is ``json.dumps`` with
``ensure_ascii=False`` (jinja's own would HTML-escape) and takes ``indent`` / ``separators`` / ``sort_keys``;
``raise_exception``, ``strftime_now``, a restricted ``dict`` and ``namespace``; ``{% generation %}`` blocks render their
body; the variables are ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``. Message
keys whose value is None are dropped first (as transformers does: templates test for a missing key, and would print
``None``). One conversion is ours: an assistant tool call's ``function.arguments``, a JSON string in the OpenAI
format, is parsed into a dict, because templates write it with ``arguments | tojson`` (Qwen2.5, Llama 3.1), which
would quote the string a second time; templates that accept either a string or a dict print the dict the same way.
Tools are passed as given (transformers does not wrap them either): OpenAI tool dicts
``{"type": "function", "function": {...}}`` are what templates expect.

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
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pask_jax.models.tokenizer import read_gguf_metadata

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


class ChatTemplateError(ValueError):
    """A chat template could not render a conversation (its own ``raise_exception``, an undefined value, bad syntax)."""


def tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """An OpenAI tool dict ``{"type": "function", "function": {...}}`` -> its function dict; a bare function as is."""
    function = tool.get("function")
    return function if tool.get("type") == "function" and isinstance(function, Mapping) else tool


def tool_call_arguments(arguments: str | Mapping[str, Any]) -> dict[str, Any]:
    """A tool call's ``arguments``: the OpenAI JSON-object string (or an already parsed dict) -> a dict."""
    if isinstance(arguments, Mapping):
        return copy.deepcopy(dict(arguments))
    try:
        parsed = json.loads(arguments)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"tool call arguments {arguments!r} are not a JSON string: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"tool call arguments {arguments!r} are not a JSON object")
    return parsed


def _template_message(index: int, message: Any) -> dict[str, Any]:
    """One message as the template sees it: None-valued keys dropped, tool-call arguments parsed into dicts."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {index} must be a dict with a string 'role', not {message!r}")
    out = {key: copy.deepcopy(value) for key, value in message.items() if value is not None}
    for k, call in enumerate(out.get("tool_calls", [])):
        target = call.get("function", call) if isinstance(call, dict) else None  # OpenAI shape, or {name, arguments}
        if not isinstance(target, dict) or "name" not in target:
            raise ValueError(f"message {index}: tool call {k} has no function name: {call!r}")
        if "arguments" in target:
            try:
                target["arguments"] = tool_call_arguments(target["arguments"])
            except ValueError as exc:
                raise ValueError(f"message {index}: tool call {k}: {exc}") from exc
    return out


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` refusing underscore-prefixed attributes (a sandbox escape route), as transformers'."""

    def __init__(*args: Any, **kwargs: Any):  # jinja's signature: ``self`` may also be an attribute name
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")


class _Dict:
    """``dict(...)`` / ``dict.fromkeys(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's jinja chat template with the special-token strings it may print (``{{ bos_token }}``)."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    name: str = "chat_template"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """OpenAI-style messages (system / user / assistant with content and/or ``tool_calls`` / tool results) and
        OpenAI tool dicts -> the prompt text, as ``tokenizer.apply_chat_template(..., tokenize=False)`` writes it."""
        template_messages = [_template_message(i, message) for i, message in enumerate(messages)]
        if tools is not None:
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ValueError(f"tool {i} must be a dict (an OpenAI tool), not {tool!r}")
            tools = copy.deepcopy(list(tools))
        special = {key: value for key, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if value}
        try:
            return _compile(self.source).render(
                messages=template_messages, tools=tools, add_generation_prompt=add_generation_prompt, **special
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template {self.name}: {exc}") from exc


def _token_text(token: Any) -> str | None:
    """A tokenizer_config / special_tokens_map token entry: a string or an AddedToken dict ``{"content": ...}``."""
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _hf_templates(directory: Path) -> tuple[dict[str, str], str | None, str | None]:
    """{template name: source}, bos, eos of an HF checkpoint directory, read as transformers reads them."""
    config = _read_json(directory / "tokenizer_config.json")
    value, templates = config.get("chat_template"), {}
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):
        templates.update((entry["name"], entry["template"]) for entry in value)
    elif value is not None:
        raise ValueError(
            f"{directory}/tokenizer_config.json: chat_template is neither a string nor a list of templates"
        )
    if (directory / "chat_template.jinja").is_file():  # the file format transformers saves now wins over the entry
        templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if (directory / "additional_chat_templates").is_dir():
        for file in sorted((directory / "additional_chat_templates").glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    special = {**config, **_read_json(directory / "special_tokens_map.json")}  # the map overrides, as in transformers
    return templates, _token_text(special.get("bos_token")), _token_text(special.get("eos_token"))


def _gguf_templates(path: Path) -> tuple[dict[str, str], str | None, str | None]:
    """{template name: source}, bos, eos from GGUF metadata (llama.cpp's ``tokenizer.chat_template[.name]`` keys)."""
    meta = read_gguf_metadata(path)
    templates = {"default": meta["tokenizer.chat_template"]} if "tokenizer.chat_template" in meta else {}
    templates.update(
        (name, meta[f"tokenizer.chat_template.{name}"]) for name in meta.get("tokenizer.chat_templates", [])
    )
    tokens = meta.get("tokenizer.ggml.tokens", [])

    def token(key: str) -> str | None:
        token_id = meta.get(key)
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    return templates, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")


def load_chat_template(path: str | Path, name: str | None = None) -> ChatTemplate | None:
    """The chat template a checkpoint ships, or None if it has none.

    ``path``: an HF checkpoint directory (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``,
    plus any ``additional_chat_templates/*.jinja``) or a ``.gguf`` file (metadata ``tokenizer.chat_template``).
    ``name`` picks one of several named templates; by default "default", else the first. (transformers would pick
    "tool_use" when tools are passed; ask for it by name.)
    """
    path = Path(path).expanduser()
    if path.is_dir():
        templates, bos, eos = _hf_templates(path)
    elif path.is_file() and path.suffix == ".gguf":
        templates, bos, eos = _gguf_templates(path)
    elif not path.exists():
        raise FileNotFoundError(f"{path} does not exist; expected an HF checkpoint directory or a .gguf file")
    else:
        raise ValueError(
            f"cannot read a chat template from {path}; expected an HF checkpoint directory or a .gguf file"
        )
    if name is not None and name not in templates:
        raise ValueError(f"{path} has no chat template named {name!r}; it has {sorted(templates) or 'none'}")
    if not templates:
        return None
    chosen = name or ("default" if "default" in templates else next(iter(templates)))
    return ChatTemplate(templates[chosen], bos_token=bos, eos_token=eos, name=f"{path.name}:{chosen}")


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

"""Chat templates: a checkpoint's own (jinja, as transformers renders it).

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

"""One request builder: an OpenAI chat-completions body -> prompt text, token ids, prompt roles and a grammar.

Every entry point goes through it (the `LLM` API, `pask-jax run`, calibration, the experiments):

    body (dict) --parse_request--> ChatRequest --RequestBuilder.prepare--> PreparedRequest
                                                 (chat template, tokenizer, prompt roles, compiled grammar)

`parse_request` needs no tokenizer or model, so a batch's bad lines are found before anything is loaded.
What a request may ask (`CHAT_FIELDS`): messages, tools, tool_choice ("auto" | "required" | "none" | a named function),
parallel_tool_calls, response_format (text | json_object | json_schema), max_tokens / max_completion_tokens,
temperature, top_p, seed, stop. Fields we cannot honour (`REFUSED_FIELDS`: n > 1, streaming, log-probabilities,
penalties, logit_bias, audio) are an error naming them; other unknown fields are ignored with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from pask_jax.arguments import DEFAULT_GRAMMAR_BACKEND
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure import parse_tools
from pask_jax.structure.backend import Grammar, GrammarBackend, backend_for
from pask_jax.structure.prompt_roles import TokenLabels, token_labels

T = TypeVar("T")

DEFAULT_MAX_TOKENS = 256
CHAT_FIELDS = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
    }
)
IGNORED_FIELDS = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options"})
# field -> the value we can honour (anything else is refused)
REFUSED_FIELDS = {
    "n": 1,
    "stream": False,
    "logprobs": False,
    "top_logprobs": None,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
}
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request we cannot run; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request (tools normalized to function dicts with JSON Schema parameters)."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()  # {"name", "description", "parameters"}
    tool_choice: str = "auto"  # "auto" | "required" | "none" (a named function: "required" over that one tool)
    forced_tool: str | None = None
    parallel_tool_calls: bool = True
    response_schema: dict | None = None  # json_schema's schema
    response_json: bool = False  # response_format json_object or json_schema
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    @property
    def constrained(self) -> bool:
        """Whether decoding follows a grammar (tool calls or a JSON response)."""
        return bool(self.tools and self.tool_choice != "none") or self.response_json


def _number(body: dict, key: str, default, kind, low=None, high=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"{key}={value} is outside [{low}, {high}]")
    return kind(value)


def _messages(raw: Any) -> tuple[dict, ...]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in MESSAGE_ROLES:
            raise RequestError(f"messages[{i}] needs a role among {', '.join(MESSAGE_ROLES)}")
        message = dict(message)
        if message["role"] == "developer":  # OpenAI's newer name for the system message
            message["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            message["content"] = "".join(p.get("text", "") for p in content)
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string, a list of text parts or null")
        if message.get("content") is None and not message.get("tool_calls"):
            raise RequestError(f"messages[{i}] has neither content nor tool_calls")
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"messages[{i}].tool_calls[{j}] needs function.name")
            if isinstance(function.get("arguments"), str):
                try:
                    json.loads(function["arguments"])
                except json.JSONDecodeError as e:
                    raise RequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}") from None
        out.append(message)
    return tuple(out)


def _tool_choice(raw: Any, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw in ("auto", "required", "none"):
        if raw == "required" and not tools:
            raise RequestError("tool_choice 'required' needs tools")
        return raw, None
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(name, str):
        raise RequestError(f"tool_choice must be auto, required, none or a named function, got {raw!r}")
    if name not in {t["name"] for t in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools")
    return "required", name


def _response_format(raw: Any) -> tuple[bool, dict | None]:
    if raw is None or raw == {"type": "text"}:
        return False, None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        schema = (raw.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs json_schema.schema (a JSON Schema object)")
        return True, schema
    raise RequestError(f"response_format must be text, json_object or json_schema, got {raw!r}")


def parse_request(
    body: Any, *, default_max_tokens: int = DEFAULT_MAX_TOKENS, check_schemas: bool = True
) -> ChatRequest:
    """Validate an OpenAI chat-completions body -> ChatRequest (RequestError naming the problem). `check_schemas`:
    refuse tool schemas our grammar cannot enforce exactly now (False: left to the grammar backend,
    `RequestBuilder.parse`)."""
    if not isinstance(body, dict):
        raise RequestError(f"a request body must be a JSON object, got {type(body).__name__}")
    for key, honoured in REFUSED_FIELDS.items():
        if key in body and body[key] not in (honoured, None):
            raise RequestError(f"{key}={body[key]!r} is not supported (only {honoured!r})")
    unknown = sorted(set(body) - CHAT_FIELDS - IGNORED_FIELDS - set(REFUSED_FIELDS))
    if unknown:
        warnings.warn(f"ignoring unknown request field(s): {', '.join(unknown)}", stacklevel=2)
    try:
        tools = tuple(parse_tools(body.get("tools") or [], check_schemas=check_schemas))
    except ValueError as e:
        raise RequestError(f"tools: {e}") from None
    tool_choice, forced = _tool_choice(body.get("tool_choice"), tools)
    response_json, response_schema = _response_format(body.get("response_format"))
    if response_json and tools and tool_choice != "none":
        raise RequestError("response_format json and tool calls cannot both constrain one answer: set tool_choice none")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestError("stop must be a non-empty string or a list of up to 4 of them")
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise RequestError("parallel_tool_calls must be true or false")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=tools,
        tool_choice=tool_choice,
        forced_tool=forced,
        parallel_tool_calls=body.get("parallel_tool_calls", True),
        response_schema=response_schema,
        response_json=response_json,
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, int, 1),
        temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, float, 1e-6, 1.0),
        seed=_number(body, "seed", 0, int),
        stop=stop,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedRequest:
    """What the engine needs for one request.

    `compiled` is the grammar, or a Future of it while a host worker compiles it (`RequestBuilder.prepare` with
    `workers`): `grammar` waits for it, `grammar_ready` says whether it would wait."""

    request: ChatRequest
    text: str  # the rendered prompt, ending with the assistant turn's header
    ids: list[int]
    roles: list[int]  # one role id per prompt token
    compiled: Grammar | Future[Grammar] | None  # None: free text; compiled by the builder's grammar backend
    tools: list[int] | None = None  # per prompt token, the grammar's tool it describes (None: no tool is described)

    @classmethod
    def labelled(
        cls,
        request: ChatRequest,
        text: str,
        ids: list[int],
        labels: TokenLabels,
        grammar: Grammar | Future[Grammar] | None,
        function_names: Sequence[str] | None = None,
    ) -> PreparedRequest:
        """From the prompt's token labels: tools numbered as the grammar's callable functions (`function_names`, or
        the compiled grammar's)."""
        if function_names is None:
            function_names = grammar.function_names if grammar is not None else ()
        tools = labels.tools_for(tuple(function_names)) if labels.tool_names else None
        return cls(request, text, ids, labels.roles, grammar, tools)

    @property
    def grammar(self) -> Grammar | None:
        """The compiled grammar (None: free text); waits for a worker still compiling it and raises its error."""
        return self.compiled.result() if isinstance(self.compiled, Future) else self.compiled

    @property
    def grammar_ready(self) -> bool:
        return not isinstance(self.compiled, Future) or self.compiled.done()

    def when_ready(self, build: Callable[[PreparedRequest], T]) -> T | Future[T]:
        """`build(self)` now if the grammar is compiled, else a Future of it, resolved (or failed with the compile's
        error) when the grammar is."""
        if self.grammar_ready:
            return build(self)
        built: Future[T] = Future()

        def finish(_: Future) -> None:
            try:
                built.set_result(build(self))
            except Exception as exc:  # the compile's GrammarError, reported where the request is admitted
                built.set_exception(exc)

        self.compiled.add_done_callback(finish)
        return built


class RequestBuilder:
    """Renders, tokenizes, labels and compiles requests for one tokenizer and chat template.

    `max_context`: prompt + max_tokens must fit (RequestError otherwise, before any device work). `grammar_backend`:
    ``"outlines"`` (our schema translation and outlines-core; a constraint it does not enforce is refused),
    ``"outlines-loose"`` (the same, such constraints dropped), ``"llguidance"`` (`structure.guidance`) or ``"auto"``
    (outlines where it enforces every keyword, else llguidance), chosen by `structure.backend.backend_for`
    (`self.backend`: it checks tool schemas, compiles the grammars and gives their constraint).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        *,
        max_context: int | None = None,
        grammar_backend: str = DEFAULT_GRAMMAR_BACKEND,
    ):
        self.backend: GrammarBackend = backend_for(grammar_backend)
        self.tokenizer = tokenizer
        self.template = template
        self.max_context = max_context
        self.grammar_backend = grammar_backend

    def parse(self, body: Any) -> ChatRequest:
        """`parse_request`, its tool schemas judged by this builder's grammar backend."""
        request = parse_request(body, check_schemas=False)
        try:
            self.backend.check_tools(request.tools)
        except ValueError as e:
            raise RequestError(f"tools: {e}") from None
        return request

    def check_length(self, ids: Sequence[int], max_tokens: int) -> None:
        if self.max_context is not None and len(ids) + max_tokens > self.max_context:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; with max_tokens={max_tokens} it exceeds the model's context of "
                f"{self.max_context} tokens"
            )

    @staticmethod
    def callable_tools(request: ChatRequest) -> list[dict]:
        """The tools a request's grammar may call, in the order its called-tool indices count."""
        if request.response_json or request.tool_choice == "none":
            return []
        return [t for t in request.tools if request.forced_tool in (None, t["name"])]

    def grammar(self, request: ChatRequest) -> Grammar | None:
        """The request's grammar, compiled by this builder's backend (None: free text)."""
        if request.response_json:
            return self.backend.compile_json(request.response_schema, self.tokenizer)
        if not request.constrained:
            return None
        return self.backend.compile_calls(
            self.callable_tools(request),
            self.tokenizer,
            tool_choice=request.tool_choice,
            parallel=request.parallel_tool_calls,
        )

    def prepare(
        self, request: ChatRequest, timings: dict[str, float] | None = None, *, workers: Executor | None = None
    ) -> PreparedRequest:
        """Render with the checkpoint's chat template, tokenize, label prompt roles, compile the grammar; the seconds
        of each stage into `timings` when given (render_s, tokenize_s, roles_s, grammar_s). With `workers`, the
        grammar (nearly all of a new tool list's host time) is compiled there: the request comes back at once, its
        `compiled` a Future."""
        if self.template is None:
            raise RequestError("this model ships no chat template: give the checkpoint's tokenizer_config.json one")
        clock = StageClock(timings)
        messages = list(request.messages)
        tools = [{"type": "function", "function": t} for t in request.tools] or None
        text = clock("render_s", self.template.render, messages, tools)
        ids = clock("tokenize_s", self.tokenizer.encode, text)
        self.check_length(ids, request.max_tokens)
        labels = clock("roles_s", token_labels, text, self.tokenizer, messages, tools)
        if workers is not None and request.constrained:
            names = [t["name"] for t in self.callable_tools(request)]
            return PreparedRequest.labelled(request, text, ids, labels, workers.submit(self.grammar, request), names)
        return PreparedRequest.labelled(request, text, ids, labels, clock("grammar_s", self.grammar, request))


class StageClock:
    """Calls a stage, adding its seconds to `timings[name]` when there is a `timings` dict."""

    def __init__(self, timings: dict[str, float] | None):
        self.timings = timings

    def __call__(self, name: str, stage: Callable[..., T], *args) -> T:
        if self.timings is None:
            return stage(*args)
        start = time.perf_counter()
        result = stage(*args)
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
        return result

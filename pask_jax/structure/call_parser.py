"""Tool calls written in an answer's text -> OpenAI ``tool_calls`` (no JAX; ``jsonschema`` checks the arguments).

Under ``tool_choice="auto"`` the grammar lets the model answer in text, and small models often write their call
there instead of taking the grammar's ``<tool_call>`` branch. ``parse_text_calls`` reads such calls back, as vLLM's
tool parsers and llama.cpp's chat formats do. The rule, exactly:

1. **Candidates.** If the whole answer, stripped of surrounding whitespace, is one JSON object or list, that value is
   the only candidate (a *bare* answer). Otherwise the answer is scanned left to right for *blocks*: a native
   ``<tool_call>...</tool_call>`` block (its body is the candidate), and a fence: three backticks, an optional
   ``json`` tag (any case), whitespace, one JSON value, whitespace and three closing backticks (that value is the
   candidate; a fence with another tag, text besides the one value, or no closing backticks has none). A block
   without its closing marker (an answer cut off by the token limit) ends the scan: the rest is content.
2. **Calls.** A candidate holds calls when it is a call object or a non-empty list of call objects, every one of them
   valid (a list is taken whole or not at all). A *call object* is a JSON object whose keys are exactly ``name`` and
   one of ``arguments`` / ``parameters`` (models write both; vLLM's parsers accept both), where ``name`` is the name of
   one of the request's tools and the arguments (a JSON object, or a string holding one) validate against that tool's
   ``parameters`` schema with ``jsonschema`` (the validator of the schema's ``$schema``, Draft 2020-12 by default;
   ``format`` is not checked). With ``parallel=False`` an answer holding more than one call holds none.
3. **Content.** A bare answer that holds calls has no content. Each block that holds calls is cut out of the answer;
   what remains, stripped, is the content (None if empty). Everything else (blocks that hold no calls, prose, JSON
   inside prose) stays as it was. An answer in which nothing holds calls is returned unchanged, not even stripped.

What the rule refuses, it refuses because the text then is an answer, not a call: JSON that names no tool of the
request, arguments the tool's schema rejects, or a call the model did not finish writing.

``split_grammar_calls`` is the other path: the calls of an answer that took the grammar's call branch (``<tool_call>``
first, or under ``auto`` a ``{`` or a fence first), whose calls the grammar already shaped, so they are kept without
checking the schema (the grammar loosens some keywords, such as ``multipleOf``, and such a call is still the model's
call).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError, UnknownType

try:  # jsonschema >= 4.18 resolves $ref through `referencing`
    from referencing.exceptions import Unresolvable
except ImportError:  # older jsonschema 4.x
    from jsonschema.exceptions import RefResolutionError as Unresolvable

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
_ARGUMENT_KEYS = ("arguments", "parameters")
_BLOCK_START = re.compile(re.escape(TOOL_CALL_OPEN) + "|" + re.escape(FENCE))
_FENCE_TAG = re.compile(r"(?i:json)?\s*")
_FENCE_END = re.compile(r"\s*" + re.escape(FENCE))
_DECODER = json.JSONDecoder()
_OPENING = re.compile(r"\s*(?:" + re.escape(TOOL_CALL_OPEN) + "|" + re.escape(FENCE) + r"json)?\s*")
_CLOSING = re.compile(r"\s*(?:" + re.escape(TOOL_CALL_CLOSE) + "|" + re.escape(FENCE) + ")?")


def openai_tool_call(name: str, arguments: Any) -> dict:
    """One call in OpenAI's shape: a fresh id, the arguments as a JSON string."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def split_grammar_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer that took the grammar's call branch: its ``{"name", "arguments"}`` call
    objects, in order, unchecked (the grammar shaped them). Each call may open with ``<tool_call>``, a ```` ```json ````
    fence or nothing and close with ``</tool_call>``, a fence or nothing: one call automaton serves every opening
    under ``tool_choice="auto"`` (``regex.py``), so openings and closings need not pair. The scan stops at the first
    text that is not a complete call object (cut off by the token limit, or malformed): that text is the content
    (stripped; None if empty)."""
    calls, pos = [], 0
    while pos < len(text):
        start = _OPENING.match(text, pos).end()
        try:
            call, end = _DECODER.raw_decode(text, start)
            name, arguments = call["name"], call["arguments"]
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        calls.append(openai_tool_call(name, arguments))
        pos = _CLOSING.match(text, end).end()
    return (text[pos:].strip() or None), calls


def parse_text_calls(text: str, tools: Sequence[dict], *, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a text answer under ``tool_choice="auto"``, by the rule in the module docstring.

    `tools`: the request's function dicts (``{"name", "parameters", ...}``, as ``parse_tools`` makes them)."""
    schemas = {tool["name"]: tool.get("parameters") or {"type": "object"} for tool in tools}
    bare = _bare_value(text)
    if bare is not _NOTHING:
        calls = _calls_of(bare, schemas)
        return (None, calls) if calls and (parallel or len(calls) == 1) else (text, [])
    kept, calls, pos = [], [], 0
    while (match := _BLOCK_START.search(text, pos)) is not None:
        block = _native_block(text, match.start()) if match.group() == TOOL_CALL_OPEN else _fence(text, match.start())
        if block is None:  # unfinished: the answer was cut off inside it
            break
        end, candidate = block
        block_calls = _calls_of(candidate, schemas)
        if block_calls:
            kept.append(text[pos : match.start()])
            calls.extend(block_calls)
            pos = end
        else:  # not a call: keep scanning after it, the block stays in the text
            kept.append(text[pos:end])
            pos = end
    if not calls or (not parallel and len(calls) > 1):
        return text, []
    content = ("".join(kept) + text[pos:]).strip()
    return (content or None), calls


class _Nothing:
    """No candidate (distinct from JSON null, which is a value)."""


_NOTHING: Any = _Nothing()


def _bare_value(text: str) -> Any:
    """The JSON value that is the whole stripped answer, or _NOTHING."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):  # only objects and lists can hold calls; skip parsing prose
        return _NOTHING
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        return _NOTHING


def _native_block(text: str, start: int) -> tuple[int, Any] | None:
    """(end of the ``<tool_call>`` block at `start`, its JSON body or _NOTHING), or None if it never closes."""
    end = text.find(TOOL_CALL_CLOSE, start)
    if end < 0:
        return None
    try:
        candidate = json.loads(text[start + len(TOOL_CALL_OPEN) : end])
    except json.JSONDecodeError:
        candidate = _NOTHING
    return end + len(TOOL_CALL_CLOSE), candidate


def _fence(text: str, start: int) -> tuple[int, Any] | None:
    """(end of the fence opening at `start`, its one JSON value or _NOTHING), or None if it never closes.

    The value is decoded in place (not cut at the next backticks), so a string argument holding backticks (code)
    does not end the fence."""
    body = _FENCE_TAG.match(text, start + len(FENCE)).end()
    try:
        candidate, value_end = _DECODER.raw_decode(text, body)
    except json.JSONDecodeError:
        pass
    else:
        if (closing := _FENCE_END.match(text, value_end)) is not None:
            return closing.end(), candidate
    end = text.find(FENCE, start + len(FENCE))  # not one JSON value: the fence is text up to its closing backticks
    return None if end < 0 else (end + len(FENCE), _NOTHING)


def _calls_of(candidate: Any, schemas: dict[str, dict]) -> list[dict]:
    """The OpenAI calls a candidate holds: all of a call object or of a non-empty list of them, else none."""
    objects = candidate if isinstance(candidate, list) else [candidate]
    calls = [_call(obj, schemas) for obj in objects]
    if not calls or any(call is None for call in calls):
        return []
    return calls


def _call(obj: Any, schemas: dict[str, dict]) -> dict | None:
    """One call object -> an OpenAI call, or None when it is not a valid call of one of the tools."""
    if not isinstance(obj, dict) or len(obj) != 2 or not isinstance(obj.get("name"), str):
        return None
    keys = [key for key in _ARGUMENT_KEYS if key in obj]
    if len(keys) != 1 or obj["name"] not in schemas:
        return None
    arguments = obj[keys[0]]
    if isinstance(arguments, str):  # OpenAI's own shape: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict) or not _validates(arguments, schemas[obj["name"]]):
        return None
    return openai_tool_call(obj["name"], arguments)


def _validates(arguments: dict, schema: dict) -> bool:
    """Whether arguments validate against a tool's parameters (a schema we cannot use validates nothing)."""
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_class.check_schema(schema)
        return validator_class(schema).is_valid(arguments)
    except (SchemaError, UnknownType, Unresolvable):
        return False

"""Regex assembly: call schemas -> outlines-core regexes of a whole assistant turn.

What the model may write (``framing="tool_call"``, Qwen's own format), then the end of turn (``<|im_end|>``)::

    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>

with ``parallel=True`` one or more such blocks separated by ``\\n``. ``framing="json_fence"`` is what
Qwen2.5-Coder writes unconstrained: a Markdown ``json`` fence around the same call object, often pretty-printed (so
there the whitespace pattern also allows a newline plus indentation); with ``parallel=True`` the fence holds one or
more calls as JSON lines (one call object after another, separated by ``\\n``), which is how that model writes
several calls when it does. A ``response_format`` turn (``json_regex``) is one JSON value of a schema, then the end.

``tool_choice="auto"`` (``tool_call`` framing) adds a text answer, and steers a call the model starts in its own
habit: an answer whose first character (past whitespace) is ``{`` or a backtick is a call, not text. The call object
then stands alone or in a ```` ```json ```` fence, and its JSON is the same schema-shaped call as in ``<tool_call>``
(the text parse-back returns it, ``call_parser``). A text answer is any bytes but the marker bytes that do not open
so. One call automaton serves the three openings, so the grammar does not pair an opening with its closing (a call
may open with ``<tool_call>`` and close with a fence): pairing them would repeat the automaton and double the
compile time (3.5 s -> 7.8 s for five tools over Qwen's vocabulary; shared: 4.2 s).

Inside a call the JSON is tight: the whitespace pattern is ``[ ]?`` (at most one space wherever JSON allows
whitespace), so ``json.dumps``'s ``", "`` / ``": "`` separators are accepted but the model cannot spend tokens on runs
of whitespace (json_fence: ``(?:[ ]?|\\n[ ]*)``, one space or a newline and an indent; a bounded indent,
``\\n[ ]{0,16}``, would triple the DFA). Keys come in schema order ("name" before "arguments", arguments in the order
the function declares them) because outlines-core's schema regex emits properties in order; optional arguments may
be left out. Strings may hold any character but raw control characters and the JSON escapes, ``\\uXXXX`` included
(outlines-core's string pattern lacks it; ``json.dumps`` writes it for every non-ASCII character, so we add it).

**outlines-core 0.2.14 defect, and the workaround.** In 0.2.14 the index drops transitions out of a *final* state
(a complete match) into non-final states: ``x(,x)*`` after ``x`` refuses ``,`` (fixed upstream, not released). A
single call object is unaffected (nothing follows its closing brace), repeated calls are: after the first
``</tool_call>`` the separating ``\\n`` would be refused. Two measures: (1) the end of turn is part of every regex
(the ``\\x04`` marker is its last symbol), so no state is final before the turn is over; outlines-core's own EOS
(allowed only in final states) is given an id that never matters, another EOS id of the tokenizer
(``<|endoftext|>`` for Qwen); (2) a parallel ``tool_call`` regex holds one block followed by ``\\n`` *or* the end of
turn, and the host restarts the guide after ``\\n`` (``Guide.reset``): exact, since the next symbol is the atomic
``<tool_call>`` token, and it builds the call automaton once (outlines-core does not minimise its DFA, so
``call(\\ncall)*`` has twice the states and compile time). ``tests/structure/test_grammar.py`` keeps a strict-xfail
test of the raw defect, which fails (XPASS) once a fixed release is installed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from outlines_core.json_schema import build_regex_from_schema

from pask_jax.structure.numbers import bounded_regex
from pask_jax.structure.schema import NUMERIC_BOUNDS, GrammarError
from pask_jax.structure.schema_rewrite import read_bounds
from pask_jax.structure.tools import call_schema
from pask_jax.structure.vocabulary import GrammarVocabulary

FRAMINGS = ("tool_call", "json_fence")
TOOL_CHOICES = ("required", "auto")  # "none" needs no grammar; a named function is "required" of that one function
TIGHT_WHITESPACE = r"[ ]?"
FENCE_WHITESPACE = r"(?:[ ]?|\n[ ]*)"  # json_fence: the model pretty-prints inside fences (newline + indent)
# tool_choice="auto": a text answer holds no marker byte and does not open with { or a backtick (that is a call)
FREE_TEXT = r"(?:[ \t\r\n]*[^\x02\x03\x04{` \t\r\n][^\x02\x03\x04]*)?"

# outlines-core's JSON string escapes lack \uXXXX; json.dumps writes it for every non-ASCII character.
_OUTLINES_ESCAPE = r'\\["\\/bfnrt]'
_JSON_ESCAPE = r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'


def schema_regex(schema: dict, whitespace: str, where: str) -> str:
    """outlines-core's regex of an enforced schema (``schema.enforced_schema`` / ``call_schema``), with the
    ``\\uXXXX`` escape added to its strings and bounded numbers written as exact ranges; ``where`` names the
    schema in errors."""
    schema, ranges = _range_placeholders(schema)
    try:
        regex = build_regex_from_schema(json.dumps(schema), whitespace)
    except Exception as exc:  # outlines-core raises ValueError / TypeError / its own errors
        raise GrammarError(
            f"{where}: outlines-core cannot build a regex from its schema ({exc}); simplify or fix that schema "
            "(the supported keywords are in schema.SCHEMA_KEYWORDS)"
        ) from exc
    if _OUTLINES_ESCAPE in regex:
        regex = regex.replace(_OUTLINES_ESCAPE, _JSON_ESCAPE)
    for marker, pattern in ranges.items():
        if f'"{marker}"' not in regex:
            raise GrammarError(f"{where}: outlines-core did not write the placeholder of a bounded number as expected")
        regex = regex.replace(f'"{marker}"', f"(?:{pattern})")
    return regex


def _range_placeholders(schema: dict) -> tuple[dict, dict[str, str]]:
    """``schema`` with each bounded ``integer`` / ``number`` node replaced by a ``const`` string no other part of
    the schema holds, and each placeholder's range regex: outlines-core takes no bounds, and a const string is
    written into its regex as the quoted text, easy to find and replace."""
    text = json.dumps(schema)
    nonce = 0
    while f"pasknumber{nonce}x" in text:
        nonce += 1
    ranges: dict[str, str] = {}

    def walk(node: object) -> object:
        if not isinstance(node, dict):
            return node
        if node.get("type") in ("integer", "number") and any(k in node for k in NUMERIC_BOUNDS):
            low, high = read_bounds(node)
            pattern = bounded_regex(node["type"] == "integer", low, high)
            if pattern is None:  # enforced_schema drops empty ranges; a hand-written one is refused here
                raise GrammarError(f"numeric bounds {low} / {high} leave no {node['type']}")
            marker = f"pasknumber{nonce}x{len(ranges)}"
            ranges[marker] = pattern
            return {"const": marker}
        out = dict(node)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                out[key] = walk(node[key])
        if isinstance(node.get("properties"), dict):
            out["properties"] = {name: walk(sub) for name, sub in node["properties"].items()}
        if isinstance(node.get("anyOf"), list):
            out["anyOf"] = [walk(branch) for branch in node["anyOf"]]
        return out

    return walk(schema), ranges


def _calls_regex(functions: Sequence[dict], whitespace: str, loosen: bool) -> str:
    if not functions:
        raise GrammarError("the tool list is empty: a tool-call grammar needs at least one function")
    calls = [schema_regex(call_schema(f, loosen=loosen), whitespace, f"function {f['name']!r}") for f in functions]
    return "(?:" + "|".join(f"(?:{call})" for call in calls) + ")"


def check_choice(framing: str, tool_choice: str, vocab: GrammarVocabulary | None) -> None:
    if framing not in FRAMINGS:
        raise GrammarError(f"unknown framing {framing!r}; choose one of {FRAMINGS}")
    if tool_choice not in TOOL_CHOICES:
        raise GrammarError(
            f"tool_choice {tool_choice!r} has no grammar here: choose one of {TOOL_CHOICES} (for 'none' decode "
            "unconstrained; for a named function compile 'required' with that function alone)"
        )
    if tool_choice == "auto" and (framing != "tool_call" or (vocab is not None and not vocab.atomic_calls)):
        raise GrammarError(
            "tool_choice 'auto' needs framing 'tool_call' and a tokenizer with <tool_call> special tokens: only an "
            "atomic <tool_call> token tells the start of a call from the start of a text answer"
        )


def tool_call_regex(
    functions: Sequence[dict],
    framing: str = "tool_call",
    parallel: bool = True,
    *,
    tool_choice: str = "required",
    vocab: GrammarVocabulary | None = None,
    whitespace: str | None = None,
    host_repeat: bool = True,
    loosen: bool = False,
) -> str:
    """The regex of an assistant turn: one call (``parallel``: one or more, separated by newlines), then the end.

    ``functions`` are function dicts (``schema.parse_tools``).
    ``tool_call``: ``<tool_call>\\n{call}\\n</tool_call>``, parallel calls separated by ``\\n``. With
    ``host_repeat`` (what ``compile_grammar`` uses when the tokenizer has ``<tool_call>`` special tokens) the
    parallel regex holds **one** call followed by either the separator or the end of turn, and the host restarts the
    guide after a separator: the call's automaton is built once, where the whole-language regex (``host_repeat=False``:
    ``call (\\n call)* end``) repeats it and, as outlines-core does not minimise its DFA, doubles the states and the
    compile time. The restart is exact because the next symbol, ``<tool_call>``, is a special token that no token can
    straddle.
    ``json_fence``: a fence, ``json``, newline, the call, newline, a closing fence; parallel calls are JSON lines inside
    the one fence (``{call}\\n{call}``: what Qwen2.5-Coder writes when it makes several calls), as a whole-language
    regex (a restarted guide would expect a new fence, not the next call).
    ``tool_choice="auto"`` (``tool_call`` framing only): a text answer then the end of turn, or the calls as above,
    the first of which may also be written bare or in a ```` ```json ```` fence (the module docstring).
    ``vocab`` supplies the framing symbols (default: Qwen's special tokens as the marker bytes ``\\x02``,
    ``\\x03``, ``\\x04``); ``whitespace`` overrides the framing's whitespace pattern inside the JSON. ``loosen``:
    drop the constraints the grammar does not enforce instead of refusing them (``schema_rewrite.enforced_schema``).
    """
    check_choice(framing, tool_choice, vocab)
    call_open, call_close, end = (
        (vocab.call_open, vocab.call_close, vocab.end_of_turn) if vocab is not None else (r"\x02", r"\x03", r"\x04")
    )
    if framing == "json_fence":
        call = _calls_regex(functions, FENCE_WHITESPACE if whitespace is None else whitespace, loosen)
        calls = f"{call}(?:\\n{call})*" if parallel else call
        return f"```json\\n{calls}\\n```{end}"
    call = _calls_regex(functions, TIGHT_WHITESPACE if whitespace is None else whitespace, loosen)
    close = f"\\n{call_close}" + (f"(?:\\n|{end})" if parallel and host_repeat else end)
    if tool_choice == "auto":  # one call automaton for every opening (see the module docstring)
        return f"(?:{FREE_TEXT}{end}|(?:{call_open}\\n|```json\\n)?{call}(?:{close}|\\n```{end}|{end}))"
    block = f"{call_open}\\n{call}\\n{call_close}"
    if not parallel:
        return f"{block}{end}"
    if host_repeat:
        return f"{block}(?:\\n|{end})"
    return f"{block}(?:\\n{block})*{end}"


def json_regex(schema: dict, *, vocab: GrammarVocabulary | None = None, whitespace: str | None = None) -> str:
    """The regex of a ``response_format`` turn: one JSON value of the enforced ``schema``, then the end of turn."""
    end = vocab.end_of_turn if vocab is not None else r"\x04"
    value = schema_regex(schema, TIGHT_WHITESPACE if whitespace is None else whitespace, "response_format")
    return f"(?:{value}){end}"

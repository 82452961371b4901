"""`parse_text_calls`: calls a model wrote in its "auto" text answer become OpenAI tool calls, by the module's rule;
and `LLM.completion` applies it to "auto" text answers only (the tokens are given, no model runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pask_jax.llm import LLM
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.requests import parse_request
from pask_jax.runtime.rows import Generation, RequestStats
from pask_jax.structure.call_parser import parse_text_calls, split_grammar_calls
from pask_jax.structure.tools import parse_tools

DATA = Path(__file__).parents[1] / "data"
AUTO_REQUESTS = Path(__file__).parents[2] / "examples" / "auto_requests.jsonl"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Book a restaurant table",
        "parameters": {
            "type": "object",
            "properties": {
                "party": {"type": "integer", "minimum": 1, "maximum": 12},
                "guest": {"$ref": "#/$defs/guest"},
            },
            "required": ["party"],
            "$defs": {"guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
        },
    },
}
TOOLS = parse_tools([WEATHER, BOOK])
OSLO = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
PARTY = {"name": "book_table", "arguments": {"party": 4, "guest": {"name": "Ada"}}}


def _fence(value, tag: str = "json") -> str:
    return f"```{tag}\n{json.dumps(value, indent=2)}\n```"


def _names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text",
    [
        _fence(OSLO),
        _fence(OSLO, tag=""),
        _fence(OSLO, tag="JSON"),
        f"```json {json.dumps(OSLO)}```",  # one line
        json.dumps(OSLO),
        f"\n  {json.dumps(OSLO, indent=2)}\n\n",
        json.dumps([OSLO]),
        f"<tool_call>\n{json.dumps(OSLO)}\n</tool_call>",
        json.dumps({"name": "get_weather", "parameters": OSLO["arguments"]}),
        json.dumps({"name": "get_weather", "arguments": json.dumps(OSLO["arguments"])}),  # arguments as a string
    ],
)
def test_accepted_forms_become_one_call(text: str):
    content, calls = parse_text_calls(text, TOOLS)
    assert content is None
    assert _names_and_arguments(calls) == [("get_weather", OSLO["arguments"])]


def test_a_list_of_two_calls_and_two_fences_keep_their_order():
    for text in (_fence([OSLO, PARTY]), json.dumps([OSLO, PARTY]), f"{_fence(OSLO)}\n{_fence(PARTY, tag='')}"):
        content, calls = parse_text_calls(text, TOOLS)
        assert content is None
        assert _names_and_arguments(calls) == [("get_weather", OSLO["arguments"]), ("book_table", PARTY["arguments"])]
    # parallel_tool_calls false: two calls are not one answer's calls
    assert parse_text_calls(_fence([OSLO, PARTY]), TOOLS, parallel=False) == (_fence([OSLO, PARTY]), [])
    assert len(parse_text_calls(_fence(OSLO), TOOLS, parallel=False)[1]) == 1


def test_text_around_a_fence_stays_content():
    text = f"Let me look that up.\n\n{_fence(OSLO)}\n\nI will tell you once I know.\n"
    content, calls = parse_text_calls(text, TOOLS)
    assert content == "Let me look that up.\n\n\n\nI will tell you once I know."
    assert _names_and_arguments(calls) == [("get_weather", OSLO["arguments"])]
    content, calls = parse_text_calls(f"Checking.\n{_fence(OSLO)}", TOOLS)
    assert (content, len(calls)) == ("Checking.", 1)


def test_a_fence_that_holds_no_call_stays_but_a_later_call_fence_is_taken():
    example = _fence({"city": "Oslo"})
    text = f"Arguments look like:\n{example}\nso I call:\n{_fence(OSLO)}"
    content, calls = parse_text_calls(text, TOOLS)
    assert content == f"Arguments look like:\n{example}\nso I call:"
    assert len(calls) == 1


def test_backticks_inside_a_string_argument_do_not_end_the_fence():
    call = {"name": "get_weather", "arguments": {"city": "```Oslo```"}}
    content, calls = parse_text_calls(_fence(call), TOOLS)
    assert content is None and _names_and_arguments(calls) == [("get_weather", {"city": "```Oslo```"})]


@pytest.mark.parametrize(
    "text",
    [
        _fence({"name": "get_wether", "arguments": {"city": "Oslo"}}),  # unknown tool name
        _fence({"name": "get_weather", "arguments": {"unit": "celsius"}}),  # required city missing
        _fence({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}),  # not in the enum
        _fence({"name": "get_weather", "arguments": {"city": "Oslo", "wind": True}}),  # additionalProperties false
        _fence({"name": "book_table", "arguments": {"party": 40}}),  # maximum (the grammar does not enforce it)
        _fence({"name": "book_table", "arguments": {"party": 2, "guest": {}}}),  # the $ref's required name
        _fence({"name": "get_weather", "arguments": "city=Oslo"}),  # arguments a string but not JSON
        _fence({"name": "get_weather", "arguments": "[1]"}),  # arguments a JSON string of a list
        _fence({"name": "get_weather", "arguments": {"city": "Oslo"}, "parameters": {"city": "Lima"}}),  # both keys
        _fence({"name": "get_weather", "arguments": {"city": "Oslo"}, "id": 1}),  # a key besides the two
        _fence({"name": "get_weather"}),  # no arguments
        _fence({"city": "Oslo"}),  # JSON that is not a call
        _fence([OSLO, {"name": "get_weather", "arguments": {}}]),  # a list with one bad call: none of it
        _fence([]),
        '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"\n```',  # malformed JSON
        '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}} and more\n```',  # text besides the value
        '```json\n{"name": "get_weather", "arguments": {"city": "Os',  # cut off inside the fence
        f"```json\n{json.dumps(OSLO)}\n",  # cut off before the closing backticks
        _fence(OSLO, tag="python"),  # another language
        f"I would call {json.dumps(OSLO)} for that.",  # JSON inside prose is not the whole answer
        f"{json.dumps(OSLO)}\nDone.",
        f"<tool_call>\n{json.dumps(OSLO)}\n",  # unfinished native block
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',  # native, wrong type
        "The weather in Oslo is mild today.",
        "",
        "null",
    ],
)
def test_refused_forms_stay_content_unchanged(text: str):
    assert parse_text_calls(text, TOOLS) == (text, [])


def test_unusable_schema_validates_nothing():
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}]
    text = json.dumps({"name": "f", "arguments": {"x": 1}})
    assert parse_text_calls(text, tools) == (text, [])
    tools = [{"name": "f", "parameters": {"type": "object"}}]
    assert len(parse_text_calls(text, tools)[1]) == 1


def test_split_grammar_calls_keeps_the_grammar_branch_behaviour():
    """Calls from the grammar's branch are not checked against the schema; unfinished and malformed calls are text."""
    out_of_range = {"name": "book_table", "arguments": {"party": 40}}
    text = f'<tool_call>\n{json.dumps(out_of_range)}\n</tool_call>\n<tool_call>\n{{"name": 1}}\n</tool_call>\n'
    content, calls = split_grammar_calls(text)
    assert _names_and_arguments(calls) == [("book_table", {"party": 40})]
    assert content == '<tool_call>\n{"name": 1}\n</tool_call>'
    cut = f"<tool_call>\n{json.dumps(OSLO)[:-3]}"  # the token limit fell inside the call
    assert split_grammar_calls(cut) == (cut, [])


@pytest.mark.parametrize(
    "opening, closing",
    [("", ""), ("```json\n", "\n```"), ("```json\n", ""), ("<tool_call>\n", ""), ("", "\n</tool_call>")],
)
def test_split_grammar_calls_reads_every_opening_and_closing_the_auto_grammar_allows(opening, closing):
    """Under "auto" one call automaton serves every opening, so a call may close with any closing or none."""
    second = {"name": "get_weather", "arguments": {"city": "Rome"}}
    text = f"{opening}{json.dumps(OSLO)}{closing}\n<tool_call>\n{json.dumps(second)}\n</tool_call>"
    content, calls = split_grammar_calls(text)
    assert content is None
    assert _names_and_arguments(calls) == [(OSLO["name"], OSLO["arguments"]), ("get_weather", {"city": "Rome"})]


# --- through LLM.completion: the answer's tokens are given, so the parser is tested where it is wired in


@pytest.fixture(scope="module")
def llm(tiny_qwen_vocab, qwen_tok) -> LLM:
    template = ChatTemplate((DATA / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>")
    return LLM(tiny_qwen_vocab, tokenizer=qwen_tok, chat_template=template, method="full", policy=None)


def _answer(llm: LLM, body_fields: dict, tokens: list[int]) -> dict:
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "temperature": 0, "max_tokens": 96}
    prepared = llm.prepare(body | body_fields)
    stats = RequestStats(prompt_tokens=len(prepared.ids), generated_tokens=len(tokens))
    return llm.completion(prepared, Generation(tokens, "stop", stats), created=0)["choices"][0]


def test_completion_reads_calls_from_auto_text_answers_only(llm: LLM, qwen_tok):
    eos = qwen_tok.eos_token_ids[0]
    text = f"Sure.\n{_fence(OSLO)}"
    fenced = qwen_tok.encode(text) + [eos]
    auto = _answer(llm, {"tools": [WEATHER]}, fenced)
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] == "Sure."
    assert _names_and_arguments(auto["message"]["tool_calls"]) == [("get_weather", OSLO["arguments"])]

    unknown = qwen_tok.encode("Sure.\n" + _fence({"name": "get_time", "arguments": {}})) + [eos]
    refused = _answer(llm, {"tools": [WEATHER]}, unknown)
    assert refused["finish_reason"] == "stop" and "tool_calls" not in refused["message"]
    assert refused["message"]["content"] == "Sure.\n" + _fence({"name": "get_time", "arguments": {}})

    none = _answer(llm, {"tools": [WEATHER], "tool_choice": "none"}, fenced)
    assert none["finish_reason"] == "stop" and none["message"]["content"] == text
    assert "tool_calls" not in none["message"]
    bare = qwen_tok.encode(json.dumps(OSLO)) + [eos]
    as_json = _answer(llm, {"response_format": {"type": "json_object"}}, bare)
    assert as_json["message"]["content"] == json.dumps(OSLO) and "tool_calls" not in as_json["message"]

    # a stop string cuts the text first, as a server that stopped there would see it: then the fence is unfinished
    stopped = _answer(llm, {"tools": [WEATHER], "stop": "celsius"}, fenced)
    assert stopped["finish_reason"] == "stop" and "tool_calls" not in stopped["message"]


def test_completion_keeps_grammar_branch_calls(llm: LLM, qwen_tok):
    prepared = llm.prepare({"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "max_tokens": 96})
    open_id = prepared.grammar.vocab.call_open_id
    out_of_schema = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}
    tokens = [open_id, *qwen_tok.encode(f"\n{json.dumps(out_of_schema)}\n</tool_call>"), qwen_tok.eos_token_ids[0]]
    choice = _answer(llm, {"tools": [WEATHER]}, tokens)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert _names_and_arguments(choice["message"]["tool_calls"]) == [("get_weather", out_of_schema["arguments"])]
    # under "auto" a fence or { first is the call branch too; the fence may end the turn unclosed
    for text in (f"```json\n{json.dumps(OSLO)}", json.dumps(OSLO)):
        choice = _answer(llm, {"tools": [WEATHER]}, [*qwen_tok.encode(text), qwen_tok.eos_token_ids[0]])
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert _names_and_arguments(choice["message"]["tool_calls"]) == [("get_weather", OSLO["arguments"])]


def test_the_auto_request_set_is_24_ordinary_batch_lines_under_auto():
    lines = [json.loads(line) for line in AUTO_REQUESTS.read_text().splitlines()]
    assert len(lines) == 24 and len({line["custom_id"] for line in lines}) == 24
    for line in lines:
        assert (line["method"], line["url"]) == ("POST", "/v1/chat/completions")
        assert "tool_choice" not in line["body"] and line["body"]["max_tokens"] <= 128
        request = parse_request(line["body"])
        assert request.tool_choice == "auto" and request.tools

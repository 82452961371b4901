"""The request builder's parsing of OpenAI chat-completions bodies (no model, no tokenizer needed)."""

from __future__ import annotations

import pytest

from pask_jax.requests import RequestError, parse_request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


def test_defaults_and_tool_choice_modes():
    r = parse_request({"messages": USER, "tools": [WEATHER]})
    assert (r.tool_choice, r.forced_tool, r.parallel_tool_calls, r.constrained) == ("auto", None, True, True)
    assert r.tools[0]["name"] == "get_weather" and r.tools[0]["parameters"]["required"] == ["city"]
    assert parse_request({"messages": USER}).tool_choice == "none"
    assert not parse_request({"messages": USER}).constrained
    assert not parse_request({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}).constrained
    named = parse_request(
        {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert (named.tool_choice, named.forced_tool) == ("required", "get_weather")
    assert not parse_request({"messages": USER, "tools": [WEATHER], "parallel_tool_calls": False}).parallel_tool_calls


def test_sampling_fields_and_limits():
    r = parse_request({"messages": USER, "max_completion_tokens": 40, "temperature": 0, "top_p": 0.9, "seed": 7})
    assert (r.max_tokens, r.temperature, r.top_p, r.seed) == (40, 0.0, 0.9, 7)
    assert parse_request({"messages": USER, "max_tokens": 12}).max_tokens == 12
    assert parse_request({"messages": USER, "stop": "END"}).stop == ("END",)
    for bad, match in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ):
        with pytest.raises(RequestError, match=match):
            parse_request({"messages": USER} | bad)


def test_fields_we_cannot_honour_are_refused_unknown_ones_warned():
    for field, value in (("n", 2), ("stream", True), ("logprobs", True), ("frequency_penalty", 0.5)):
        with pytest.raises(RequestError, match=field):
            parse_request({"messages": USER, field: value})
    assert parse_request({"messages": USER, "n": 1, "stream": False, "model": "any"}).messages[0]["content"]
    with pytest.warns(UserWarning, match="frobnicate"):
        parse_request({"messages": USER, "frobnicate": 1})


def test_messages_and_formats():
    r = parse_request(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        }
    )
    assert r.messages[0] == {"role": "system", "content": "Be brief."} and r.response_json
    assert r.response_schema == {"type": "object"}
    assert parse_request({"messages": USER, "response_format": {"type": "json_object"}}).response_schema is None
    for bad, match in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user"}]}, "neither content nor tool_calls"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]}, "JSON"),
        ({"messages": USER, "tool_choice": "required"}, "needs tools"),
        (
            {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "nope",
        ),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": USER, "tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice none"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),
    ):
        with pytest.raises(RequestError, match=match):
            parse_request(bad)
    with pytest.raises(RequestError, match="JSON object"):
        parse_request(["not", "a", "dict"])

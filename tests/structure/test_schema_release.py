"""Schema-conditioned release: prompt tokens know the tool they describe, the parser names the tool being called,
and PASK lets the tools not called leave first."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import tiny_model

from pask_jax.methods import PaskKV
from pask_jax.methods.pask import POSITION_RANGE
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.requests import RequestBuilder, parse_request
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import mask_words
from pask_jax.runtime.step import MethodInputs, StepInput
from pask_jax.structure import Role
from pask_jax.structure.backend import grammar_constraint
from pask_jax.structure.roles import NO_TOOL

DATA = Path(__file__).parents[1] / "data"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {
    "name": "get_time",
    "description": "Local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}


def request(tools: list[dict], **fields) -> dict:
    return {
        "messages": [{"role": "user", "content": "Weather in Paris, and the time there?"}],
        "tools": [{"type": "function", "function": t} for t in tools],
        **fields,
    }


@pytest.fixture(scope="module")
def builder(qwen_tok) -> RequestBuilder:
    template = ChatTemplate((DATA / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>", name="qwen2.5")
    return RequestBuilder(qwen_tok, template)


def test_prompt_tokens_carry_the_tool_they_describe(builder, qwen_tok):
    prepared = builder.prepare(parse_request(request([WEATHER, TIME], tool_choice="required")))
    tools = np.asarray(prepared.tools)
    assert prepared.grammar.function_names == ("get_weather", "get_time")
    for index, function in enumerate((WEATHER, TIME)):
        described = qwen_tok.decode([t for t, k in zip(prepared.ids, tools, strict=True) if k == index])
        assert json.dumps(function["description"]) in described and function["name"] in described
        assert {prepared.roles[i] for i in np.flatnonzero(tools == index)} <= {
            Role.TOOL_NAME, Role.PARAM_NAME, Role.SCHEMA_VALUE, Role.DESCRIPTION, Role.SCHEMA_PUNCT
        }  # fmt: skip
    assert (tools[np.asarray(prepared.roles) == Role.REQUEST_TEXT] == NO_TOOL).all()
    # a tool the prompt lists but the call may not name (tool_choice forces the other): never the called one
    forced = builder.prepare(
        parse_request(request([WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    )
    assert forced.grammar.function_names == ("get_time",)
    assert set(forced.tools) == {NO_TOOL, 0, 1}  # get_time is 0; get_weather, listed only, is 1 (no call's index)
    assert builder.prepare(parse_request({"messages": request([])["messages"]})).tools is None


def test_the_constraint_reads_the_called_tool_per_call(builder, qwen_tok):
    prepared = builder.prepare(parse_request(request([WEATHER, TIME], tool_choice="required")))
    constraint = grammar_constraint([prepared.grammar], qwen_tok.vocab_size)
    calls = [("get_time", {"zone": "Europe/Paris"}), ("get_weather", {"city": "Paris"})]
    text = "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>" for name, args in calls
    )
    called, written = [], ""
    for token in qwen_tok.encode(text + "<|im_end|>"):
        constraint.advance(np.asarray([token]))
        written += qwen_tok.decode([token])
        called.append((written, int(constraint.called_tools()[0])))
    first_name_closed = next(i for i, (w, _) in enumerate(called) if '"get_time"' in w)
    assert all(c == NO_TOOL for _, c in called[:first_name_closed])
    second_call = next(i for i, (w, _) in enumerate(called) if w.count("<tool_call>") == 2)
    assert all(c == 1 for _, c in called[first_name_closed : second_call - 1])  # get_time while its call is written
    second_name_closed = next(i for i, (w, _) in enumerate(called) if '"get_weather"' in w)
    assert all(c == NO_TOOL for _, c in called[second_call:second_name_closed])  # the next call: unknown again
    assert called[-2][1] == 0  # get_weather


def _evicted_prompt_positions(
    model, method, tools_row: list[int], called: int, steps: int
) -> list[tuple[set[int], set[int]]]:
    """Per (layer, KV head): the prompt positions the running cap evicted over `steps` decode steps with `called`
    as the tool being called, and those still kept."""
    prompt = list(range(3, 3 + len(tools_row)))
    engine = Engine(model, method=method, budget=0.5, num_groups=1, length_buckets=(16,))
    shape = engine.batch_shape([len(prompt)], steps + 1)
    tokens, lengths, _ = shape.pad([prompt])
    roles = np.full_like(tokens, int(Role.DESCRIPTION))
    roles[0, 0] = Role.SINK
    tools = shape.pad_tools([tools_row])
    _, caches, _ = engine.prefill(tokens, lengths, roles, shape.capacities, tools)
    before = np.asarray(caches[0].pos)  # [L, B, K, C]
    bits = np.full((shape.padded_rows, mask_words(model.config.vocab_size)), -1, np.int32)
    current, positions = np.full(shape.padded_rows, 7, np.int32), lengths.copy()
    for _ in range(steps):
        step = StepInput(
            current,
            positions,
            np.zeros_like(lengths),
            lengths,
            MethodInputs(np.full(shape.padded_rows, called, np.int32)),
        )
        current, caches, _, overflow = engine.decode_step(caches, step, bits, jax.random.key(0))
        current, positions = np.asarray(current), positions + 1
        assert not bool(overflow)
    after = np.asarray(caches[0].pos)
    n = len(prompt)
    out = []
    for layer in range(before.shape[0]):
        for head in range(before.shape[2]):
            kept = {int(p) for p in after[layer, 0, head] if 0 <= p < n}
            out.append(({int(p) for p in before[layer, 0, head] if 0 <= p < n} - kept, kept))
    return out


def test_pask_evicts_the_tools_not_called_first():
    model = tiny_model("qwen2", seed=1)
    tools_row = [NO_TOOL] + [0] * 6 + [1] * 6  # the sink, then tool 0's definition, then tool 1's
    of_tool = {t: {i for i, k in enumerate(tools_row) if k == t} for t in (0, 1)}
    release = PaskKV(schema_release=True, pooling="none")  # unpooled: the prefill keeps entries of both tools
    for called, other in ((0, 1), (1, 0)):
        rows = _evicted_prompt_positions(model, release, tools_row, called, steps=4)
        assert any(evicted & of_tool[other] for evicted, _ in rows)  # the cap did take the other tool's entries
        for evicted, kept in rows:  # and the called tool's only once the other's are gone
            assert not (evicted & of_tool[called]) or not (kept & of_tool[other]), (called, evicted, kept)
    unknown = _evicted_prompt_positions(model, release, tools_row, NO_TOOL, steps=4)
    assert unknown == _evicted_prompt_positions(
        model, PaskKV(pooling="none"), tools_row, 0, steps=4
    )  # no name yet: no release
    # without the release some (layer, head) lets one tool's entries go while the other's stay: the release, for one
    # of the two calls, is what changed it
    assert any((e & of_tool[a]) and (k & of_tool[b]) for e, k in unknown for a, b in ((0, 1), (1, 0)))


def test_the_whole_tool_order_keeps_whole_tools_after_prefill():
    """At most one tool is cut per (layer, KV head) under the tool granularity; the entry order cuts several."""
    model = tiny_model("qwen2", seed=1)
    tools_row = [NO_TOOL] + [0] * 5 + [1] * 5 + [2] * 5
    of_tool = [{i for i, k in enumerate(tools_row) if k == t} for t in range(3)]

    def cut_tools(method: PaskKV) -> list[int]:  # per (layer, head): how many tools kept in part
        kept = [k for _, k in _evicted_prompt_positions(model, method, tools_row, NO_TOOL, steps=0)]
        return [sum(0 < len(k & entries) < len(entries) for entries in of_tool) for k in kept]

    assert max(cut_tools(PaskKV(pooling="none", granularity="tool"))) <= 1
    assert max(cut_tools(PaskKV(pooling="none"))) >= 2


def test_release_ranks_unchosen_entries_below_every_level():
    method = PaskKV(schema_release=True)
    priority = jnp.asarray([[[5.0 * POSITION_RANGE, 3.0, 1e30, 2.0 * POSITION_RANGE]]])  # f32[B=1, K=1, C=4]
    pos = jnp.asarray([[[4, 5, 0, 9]]])
    tool = jnp.asarray([[[1, 0, NO_TOOL, 1]]])
    out = np.asarray(method.release_unchosen_tools(0, priority, pos, tool, jnp.asarray([0])))[0, 0]
    assert out[0] < out[3] < 0 <= out[1] and out[2] == 1e30  # tool 1 released, oldest first; sink kept
    np.testing.assert_array_equal(
        method.release_unchosen_tools(0, priority, pos, tool, jnp.asarray([NO_TOOL])), priority
    )
    np.testing.assert_array_equal(PaskKV().release_unchosen_tools(0, priority, pos, tool, jnp.asarray([0])), priority)


def test_a_call_written_as_text_under_auto_gets_the_call_roles(builder, qwen_tok):
    prepared = builder.prepare(parse_request(request([WEATHER, TIME])))  # tool_choice defaults to "auto"
    assert prepared.grammar.kind == "auto"
    constraint = grammar_constraint([prepared.grammar], qwen_tok.vocab_size)
    text = 'Sure:\n```json\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n```\nDone.'
    by_role: dict[int, str] = {}
    for token in qwen_tok.encode(text + "<|im_end|>"):
        role = int(constraint.advance(np.asarray([token]))[0])
        by_role[role] = by_role.get(role, "") + qwen_tok.decode([token])
    assert "Sure" in by_role[Role.FREE_TEXT] and "Done" in by_role[Role.FREE_TEXT]
    assert "get_time" in by_role[Role.FUNCTION_NAME] and "zone" in by_role[Role.ARG_KEY]
    assert "Europe/Paris" in by_role[Role.ARG_STRING] and by_role[Role.END_OF_TURN] == "<|im_end|>"
    assert "get_time" not in by_role[Role.FREE_TEXT]
    assert constraint.called_tools()[0] == 1  # the text call's function, read as any call's

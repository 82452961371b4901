"""`LLM.chat` and `pask-jax run` end to end on a tiny random model with the real Qwen tokenizer and chat template.

A random model writes nonsense, but under the grammar every completed call must name a tool of the request and its
arguments must validate against that tool's schema: checked with the `jsonschema` package, not our grammar.
Schemas here have bounded values (enums, booleans), so even a random model completes its call within the limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from pask_jax.batch_file import run_batch
from pask_jax.compare import call_is_valid, compare_outputs
from pask_jax.llm import LLM
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.policy import PolicyError
from pask_jax.requests import RequestError
from pask_jax.structure import grammar_cache

DATA = Path(__file__).parents[1] / "data"
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": UNIT, "city": {"enum": ["Oslo", "Lima"]}},
            "required": ["unit", "city"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "days": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/day"},
                    "minItems": 1,
                    "maxItems": 2,
                },
                "loud": {"type": ["boolean", "null"]},
            },
            "required": ["days", "loud"],
            "$defs": {"day": {"enum": ["mon", "tue"]}},
        },
    },
}
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _body(content="Weather in Oslo?", **fields):
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 64} | fields


@pytest.fixture(scope="module")
def llm(tiny_qwen_vocab, qwen_tok) -> LLM:
    template = ChatTemplate((DATA / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>")
    return LLM(tiny_qwen_vocab, tokenizer=qwen_tok, chat_template=template, method="pask", budget=0.5, policy=None)


def _schemas(*tools):
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


def test_tool_calls_validate_against_their_schemas(llm: LLM):
    requests = [
        _body(tools=[WEATHER, ALARM], tool_choice="required", parallel_tool_calls=False),
        _body(
            tools=[WEATHER, ALARM],
            tool_choice={"type": "function", "function": {"name": "set_alarm"}},
            parallel_tool_calls=False,
        ),
        _body("Weather in Lima?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False),
    ]
    answers = llm.chat(requests)
    for answer in answers:
        choice = answer["choices"][0]
        assert answer["object"] == "chat.completion" and choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1  # parallel_tool_calls false / a forced function: one call
        assert all(call_is_valid(c, _schemas(WEATHER, ALARM)) for c in calls)
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        usage = answer["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert answer["pask"]["method"] == "pask" and answer["pask"]["kept_ratio_max"] <= 0.5 + 0.02
    assert answers[1]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "set_alarm"
    ids = [a["choices"][0]["message"]["tool_calls"][0]["id"] for a in answers] + [a["id"] for a in answers]
    assert len(set(ids)) == len(ids)


def test_content_modes(llm: LLM):
    json_answer, text_answer, none_answer, auto_answer = llm.chat(
        [
            _body(response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}}),
            _body("Say hi", max_tokens=6),
            _body(tools=[WEATHER], tool_choice="none", max_tokens=6),
            _body(tools=[WEATHER], tool_choice="auto", max_tokens=64),
        ]
    )
    message = json_answer["choices"][0]["message"]
    assert json_answer["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in message
    jsonschema.validate(json.loads(message["content"]), OK_SCHEMA)
    for answer in (text_answer, none_answer):
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert isinstance(answer["choices"][0]["message"]["content"], str)
        assert "tool_calls" not in answer["choices"][0]["message"]
        assert answer["usage"]["completion_tokens"] <= 6
    auto = auto_answer["choices"][0]
    if auto["message"].get("tool_calls"):  # the model chose to call: then the calls are valid
        assert all(call_is_valid(c, _schemas(WEATHER)) for c in auto["message"]["tool_calls"])
    else:
        assert isinstance(auto["message"]["content"], str)


def test_stop_strings_cut_text_and_bad_requests_name_their_index(llm: LLM):
    (plain,) = llm.chat(_body("Say hi", max_tokens=6))
    text = plain["choices"][0]["message"]["content"]
    cut = text[1:3]
    (stopped,) = llm.chat(_body("Say hi", max_tokens=6, stop=cut))
    assert stopped["choices"][0]["message"]["content"] == text[: text.find(cut)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(RequestError, match="request 1: n=2"):
        llm.chat([_body(), _body(n=2)])
    with pytest.raises(ValueError, match="exceeds the model's context"):
        llm.chat(_body("word " * 40_000))


def test_continuous_and_static_schedulers_give_the_same_answers(llm: LLM, tiny_qwen_vocab, qwen_tok):
    """Mixed requests (calls, JSON, text; different lengths and limits) through 3 continuous rows (prefilled
    together or one at a time) and through static micro-batches: the same messages and finish reasons (ids aside)."""
    template = ChatTemplate((DATA / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>")
    common = dict(tokenizer=qwen_tok, chat_template=template, method="pask", budget=0.5, policy=None)
    bodies = [
        _body(tools=[WEATHER, ALARM], tool_choice="required", parallel_tool_calls=False),
        _body("Say hi", max_tokens=5),
        _body(response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}}),
        _body("Weather in Lima, please?", tools=[WEATHER], tool_choice="required", max_tokens=40),
        _body("Say hello to everyone", max_tokens=9),
    ]

    def answers(scheduler: str, **options) -> list:
        out = LLM(tiny_qwen_vocab, scheduler=scheduler, max_batch=3, **common, **options).chat(bodies)
        for answer in out:  # random ids differ by construction
            for call in answer["choices"][0]["message"].get("tool_calls", []):
                call.pop("id")
        return [(a["choices"][0]["message"], a["choices"][0]["finish_reason"], a["usage"]) for a in out]

    static = answers("static")
    assert answers("continuous") == static  # grammars compiled on host workers, each request admitted when done
    assert answers("continuous", prep_workers=0) == static  # compiled when prepared
    assert answers("continuous", max_prefill_rows=1) == static
    with pytest.raises(ValueError, match="unknown scheduler 'paged'"):
        LLM(tiny_qwen_vocab, scheduler="paged", **common)


def test_policy_auto_finds_none_for_a_tiny_model(tiny_qwen_vocab, qwen_tok):
    with pytest.raises(PolicyError, match="no shipped PASK policy fits"):
        LLM(tiny_qwen_vocab, tokenizer=qwen_tok, method="pask", policy="auto")
    full = LLM(tiny_qwen_vocab, tokenizer=qwen_tok, method="full", budget=0.33, policy="auto")
    assert (full.budget, full.policy) == (1.0, None)  # full KV keeps everything; no policy looked up
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        LLM(tiny_qwen_vocab, tokenizer=qwen_tok, method="magic")
    with pytest.raises(ValueError, match="budget=1.5"):
        LLM(tiny_qwen_vocab, tokenizer=qwen_tok, method="snapkv", budget=1.5)


def test_grammar_cache_dir_sets_the_process_wide_directory(tiny_qwen_vocab, qwen_tok, tmp_path: Path):
    common = dict(tokenizer=qwen_tok, method="full")
    try:
        LLM(tiny_qwen_vocab, grammar_cache_dir=tmp_path / "grammars", **common)
        assert grammar_cache.grammar_cache_dir() == tmp_path / "grammars"
        LLM(tiny_qwen_vocab, **common)  # "auto" leaves the process's setting as it is
        assert grammar_cache.grammar_cache_dir() == tmp_path / "grammars"
        LLM(tiny_qwen_vocab, grammar_cache_dir="none", **common)
        assert grammar_cache.grammar_cache_dir() is None
    finally:
        grammar_cache.set_grammar_cache(grammar_cache.AUTO)


def test_run_writes_openai_batch_output_that_validates(llm: LLM, tmp_path: Path):
    lines = [
        {"custom_id": "w", "body": _body(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)},
        {"custom_id": "j", "body": _body(response_format={"type": "json_object"}, max_tokens=24)},
        {"custom_id": "bad", "body": _body(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}])},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"method": "POST", "url": "/v1/chat/completions"} | x) + "\n" for x in lines))
    summary = run_batch(lambda: llm, inp, out)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["w"]["response"]["status_code"] == 200 and records["w"]["error"] is None
    assert records["bad"]["response"] is None and "parameters" in records["bad"]["error"]["message"]
    assert (summary.completed, summary.failed) == (2, 1) and summary.output_tokens > 0
    compared = compare_outputs(inp, [out])
    assert compared["totals"][0]["calls"] == 1 and compared["totals"][0]["valid_fraction"] == 1.0


@pytest.mark.slow
def test_bfcl_items_as_openai_requests_make_the_same_calls_as_the_bfcl_harness():
    """The default model, BFCL items through `LLM.chat` (the checkpoint's own chat template, OpenAI tools) and
    through `pask-jax bfcl`'s path (BFCL's fixed prompt): the decoded calls agree on most items. The prompts differ
    (the template adds Qwen's default system message and the tool envelope), so identity is not guaranteed."""
    from pask_jax.experiments import bfcl
    from pask_jax.experiments.bfcl.evaluate import EvalConfig, run_bfcl
    from pask_jax.experiments.bfcl.prompt import bfcl_request_body

    llm = LLM("qwen2.5-coder-0.5b", method="full", max_batch=8)
    items = [it for c in ("simple_python", "multiple") for it in bfcl.evaluation_sample(c, 0, 4)]
    bodies = [bfcl_request_body(it, max_tokens=128) for it in items]
    ours = [
        [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in a["choices"][0]["message"]["tool_calls"]
        ]
        for a in llm.chat(bodies)
    ]
    cfg = EvalConfig(categories=("simple_python", "multiple"), limit=4, max_new_tokens=128)
    result = run_bfcl(llm.model, llm.tokenizer, "qwen2.5-coder-0.5b", cfg)
    harness = {r["id"]: bfcl.parse_tool_calls(r["text"]) for run in result["runs"] for r in run["items"]}
    theirs = [[next(iter(c.items())) for c in harness[it["id"]]] for it in items]
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    assert agree >= 0.75 * len(items), (agree, list(zip(ours, theirs, strict=True)))


def test_kv_memory_limit_admits_more_rows_for_a_smaller_cache(tiny_qwen_vocab, qwen_tok, tmp_path: Path):
    template = ChatTemplate((DATA / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>")
    common = dict(tokenizer=qwen_tok, chat_template=template, policy=None)
    bodies = [_body(f"Say hi {i}", max_tokens=4) for i in range(8)]
    full = LLM(tiny_qwen_vocab, method="full", **common)
    prepared = [full.prepare(b) for b in bodies]
    shape = full.engine.batch_shape([len(p.ids) for p in prepared[:2]], 4)
    two_rows = full.engine.cache_bytes(shape)
    full.kv_memory_bytes = two_rows
    assert [len(b) for b in full.micro_batches(prepared)] == [2, 2, 2, 2]
    snap = LLM(tiny_qwen_vocab, method="snapkv", budget=0.33, kv_memory_bytes=two_rows, **common)
    assert max(len(b) for b in snap.micro_batches(prepared)) > 2  # a third of the cache: more rows in the same bytes
    rows = [llm.make_scheduler().rows(llm.jobs(prepared[:2])) for llm in (full, snap)]
    assert rows[0] == 2 and rows[1] > 2  # continuous rows: the same rule
    tight = LLM(tiny_qwen_vocab, method="full", kv_memory_bytes=16, **common)
    with pytest.raises(RequestError, match="request 0: its KV cache needs"):
        tight.chat(bodies[0])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "body": bodies[0]}) + "\n")
    summary = run_batch(lambda: tight, inp, out)
    record = json.loads(out.read_text())
    assert record["error"]["code"] == "kv_memory" and summary.failed == 1 and summary.completed == 0

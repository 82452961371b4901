"""`pask-jax run`'s batch runner: formats in and out, error records per bad line, resume without loss or repeats.

The mechanics run against a counting stand-in for `LLM` (prepare / generate), so every path is fast; the
real-model path is covered in tests/api/test_llm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pask_jax.batch_file import answered_keys, read_input, run_batch
from pask_jax.requests import RequestError, parse_request
from pask_jax.structure.schema import GrammarError


def _line(custom_id, content="hi", **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}]} | body,
    }


class CountingLLM:
    """Answers each request with its own content echoed; counts what it was asked; can die mid-run."""

    def __init__(self, die_after_batches: int | None = None, max_batch: int = 2):
        self.generated: list[str] = []
        self.die_after_batches = die_after_batches
        self.max_batch = max_batch

    def prepare(self, body, ahead=False):
        assert ahead  # grammars compile on the LLM's host workers while earlier requests run
        request = parse_request(body)
        if request.messages[0]["content"] == "too long":
            raise RequestError("the prompt has 99999 tokens; it exceeds the model's context")
        return request

    def generate(self, prepared):
        for batch, start in enumerate(range(0, len(prepared), self.max_batch)):
            if self.die_after_batches is not None and batch == self.die_after_batches:
                raise KeyboardInterrupt  # a kill between batches
            indices = list(range(start, min(start + self.max_batch, len(prepared))))
            self.generated += [prepared[i].messages[0]["content"] for i in indices]
            yield indices, [self._completion(prepared[i]) for i in indices]

    @staticmethod
    def _completion(request):
        text = request.messages[0]["content"]
        if text == "uncompilable":  # its grammar failed on a host worker: the error in place of its completion
            return GrammarError("function 'f': outlines-core cannot compile the tool-call grammar")
        return {
            "id": f"chatcmpl-{text}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "pask": {"kept_ratio_mean": 0.5, "decode_s": 0.1},
        }


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_kind_of_bad_line_gets_an_error_record_and_the_rest_go_on(tmp_path: Path):
    lines = [
        _line("ok-1", "first"),
        "{not json",
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},  # no custom_id
        _line("ok-1", "again"),  # duplicate custom_id
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        _line("bad-tool", tools=[{"type": "function", "function": {"description": "no name"}}]),
        _line("bad-field", n=3),
        _line("long", "too long"),
        _line("grammar", "uncompilable"),
        _line("ok-2", "second"),
    ]
    inp, out = _write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    llm = CountingLLM()
    summary = run_batch(lambda: llm, inp, out)
    records = {(r["custom_id"], r["error"]["line"] if r["error"] else None): r for r in _records(out)}
    assert llm.generated == ["first", "uncompilable", "second"]
    assert records[("ok-1", None)]["response"]["body"]["choices"][0]["message"]["content"] == "first"
    assert records[("ok-1", None)]["response"]["status_code"] == 200 and records[("ok-1", None)]["error"] is None
    codes = {key: r["error"]["code"] for key, r in records.items() if r["error"]}
    assert codes == {
        (None, 2): "invalid_json",
        (None, 3): "missing_custom_id",
        ("ok-1", 4): "duplicate_custom_id",
        ("wrong-url", 5): "invalid_url",
        ("bad-tool", 6): "invalid_request",
        ("bad-field", 7): "invalid_request",
        ("long", 8): "invalid_request",
        ("grammar", 9): "invalid_request",
    }
    assert "name" in records[("bad-tool", 6)]["error"]["message"]
    assert "n=3" in records[("bad-field", 7)]["error"]["message"]
    assert all(r["response"] is None for r in records.values() if r["error"])
    assert "cannot compile" in records[("grammar", 9)]["error"]["message"]
    assert (summary.completed, summary.failed, summary.requests) == (2, 8, 10)
    assert "8 failed" in summary.line()


def test_resume_after_a_kill_loses_and_repeats_nothing(tmp_path: Path):
    inp = _write(tmp_path / "in.jsonl", [_line(f"r{i}", f"text-{i}") for i in range(7)])
    out = tmp_path / "out.jsonl"
    first = CountingLLM(die_after_batches=2)  # 2 batches of 2 written, then killed
    with pytest.raises(KeyboardInterrupt):
        run_batch(lambda: first, inp, out)
    assert [r["custom_id"] for r in _records(out)] == ["r0", "r1", "r2", "r3"]
    with out.open("a") as f:  # a torn line, as a kill in the middle of a write leaves it
        f.write('{"id": "batch_req_x", "custom_id": "r4", "resp')
    second = CountingLLM()
    summary = run_batch(lambda: second, inp, out)
    assert second.generated == ["text-4", "text-5", "text-6"]  # the torn r4 counted as not answered
    ids = [r["custom_id"] for r in _records(out)]
    assert sorted(ids) == [f"r{i}" for i in range(7)] and len(ids) == len(set(ids))
    assert (summary.skipped, summary.completed) == (4, 3)
    third = CountingLLM()
    factory_calls = []
    summary = run_batch(lambda: factory_calls.append(1) or third, inp, out)
    assert third.generated == [] and factory_calls == [] and summary.skipped == 7  # nothing left: nothing loaded


def test_error_records_of_an_earlier_run_are_not_repeated_but_still_fail_the_run(tmp_path: Path):
    inp = _write(tmp_path / "in.jsonl", ["{broken", _line("a", "fine")])
    out = tmp_path / "out.jsonl"
    run_batch(CountingLLM, inp, out)
    again = run_batch(CountingLLM, inp, out)
    assert len(_records(out)) == 2 and again.failed == 0 and again.failed_before == 1
    assert answered_keys(out) == {"line:1": False, "a": True}


def test_read_input_envelopes(tmp_path: Path):
    inp = _write(tmp_path / "in.jsonl", [_line("x"), "", "[1, 2]", {"custom_id": "", "body": {}}])
    entries = read_input(inp)
    assert [(e.line, e.custom_id, e.error[0] if e.error else None) for e in entries] == [
        (1, "x", None),
        (3, None, "invalid_request"),
        (4, None, "missing_custom_id"),
    ]
    assert entries[0].body["messages"][0]["content"] == "hi"

"""`pask-jax run` on several processes: process p of n answers the input lines whose index mod n is p, into
`<output>.<p>-of-<n>`; the parts together hold what one process writes.

The split and resuming run in process against test_batch's counting stand-in; then two local CPU processes joined by
`jax.distributed` (a coordinator on a free localhost port) run the real CLI on a tiny random checkpoint, one of them
loading it straight onto a 2-way tensor-parallel mesh, and answer every request as one process does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from support import free_port
from test_batch import CountingLLM, _line, _records, _write

from pask_jax.batch_file import process_output_path, run_batch

DATA = Path(__file__).parents[1] / "data"
ROOT = Path(__file__).parents[2]


def test_processes_split_the_lines_by_index_and_together_write_what_one_process_writes(tmp_path: Path):
    lines = [_line(f"r{i}", f"content {i}") for i in range(7)] + ["{not json", _line("r2", "a duplicate")]
    inp = _write(tmp_path / "in.jsonl", lines)
    run_batch(CountingLLM, inp, tmp_path / "one.jsonl")
    expected = [  # (custom_id, line of an error record): lines 1, 4, 7 / 2, 5, 8 / 3, 6, 9
        [("r0", 0), ("r3", 0), ("r6", 0)],
        [("", 8), ("r1", 0), ("r4", 0)],  # the bad JSON line
        [("r2", 0), ("r2", 9), ("r5", 0)],  # the duplicate custom_id: judged against every line, as one process does
    ]
    asked = []
    for p in range(3):
        llm = CountingLLM()
        summary = run_batch(lambda llm=llm: llm, inp, tmp_path / "out.jsonl", process=p, processes=3)
        asked.append(llm.generated)
        part = _records(tmp_path / f"out.jsonl.{p}-of-3")
        assert sorted((r["custom_id"] or "", r["error"]["line"] if r["error"] else 0) for r in part) == expected[p]
        assert summary.requests == 3
    assert asked == [["content 0", "content 3", "content 6"], ["content 1", "content 4"], ["content 2", "content 5"]]
    merged = sorted(json.dumps(r, sort_keys=True) for p in range(3) for r in _records(tmp_path / f"out.jsonl.{p}-of-3"))
    assert merged == sorted(json.dumps(r, sort_keys=True) for r in _records(tmp_path / "one.jsonl"))
    again = CountingLLM()  # a rerun of one part: everything of its share is answered already
    summary = run_batch(lambda: again, inp, tmp_path / "out.jsonl", process=1, processes=3)
    assert again.generated == [] and summary.skipped == summary.requests == 3


def test_a_part_resumes_after_a_kill(tmp_path: Path):
    inp = _write(tmp_path / "in.jsonl", [_line(f"r{i}", f"c{i}") for i in range(8)])
    dying = CountingLLM(die_after_batches=1, max_batch=1)
    with pytest.raises(KeyboardInterrupt):
        run_batch(lambda: dying, inp, tmp_path / "out.jsonl", process=0, processes=2)
    rest = CountingLLM(max_batch=1)
    run_batch(lambda: rest, inp, tmp_path / "out.jsonl", process=0, processes=2)
    assert dying.generated == ["c0"] and rest.generated == ["c2", "c4", "c6"]
    assert sorted(r["custom_id"] for r in _records(tmp_path / "out.jsonl.0-of-2")) == ["r0", "r2", "r4", "r6"]


def test_run_refuses_a_bad_mesh_or_dtype_before_any_work(tmp_path: Path, capsys):
    from pask_jax import cli

    inp = _write(tmp_path / "in.jsonl", [_line("a")])
    run = ["run", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", "no-such-model"]
    for extra, message in ((["--mesh", "4*2"], "DATAxMODEL"), (["--mesh", "64x1"], "needs 64 devices")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(run + extra)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(run + ["--dtype", "float16"])
    assert exit_info.value.code == 2 and "float16" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_part_names():
    assert process_output_path("runs/out.jsonl") == Path("runs/out.jsonl")
    assert process_output_path("runs/out.jsonl", 3, 4) == Path("runs/out.jsonl.3-of-4")
    with pytest.raises(ValueError, match="process 4 is not in 0..3"):
        process_output_path("out.jsonl", 4, 4)


# ---- two processes through jax.distributed ----

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 151_936, 32, 64, 2, 4, 2  # the real Qwen vocabulary: its tokenizer
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "city": {"enum": ["Oslo", "Lima"]}},
            "required": ["unit", "city"],
        },
    },
}


def write_checkpoint(directory: Path, tokenizer) -> Path:
    """A tiny random Qwen2-architecture HF checkpoint directory: config, safetensors, tokenizer, chat template."""
    head_dim, rng = HIDDEN // HEADS, np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {f"{layer}.input_layernorm.weight": (HIDDEN,), f"{layer}.post_attention_layernorm.weight": (HIDDEN,)}
        for proj, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = (heads * head_dim, HIDDEN)
            shapes[f"{layer}.self_attn.{proj}_proj.bias"] = (heads * head_dim,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN, HEADS * head_dim)
        shapes |= {f"{layer}.mlp.{p}_proj.weight": (FFN, HIDDEN) for p in ("gate", "up")}
        shapes[f"{layer}.mlp.down_proj.weight"] = (HIDDEN, FFN)
    weights = {
        name: (1.0 if "norm" in name else 0.0) + rng.normal(0, 0.2, shape).astype(np.float32)
        for name, shape in shapes.items()
    }
    directory.mkdir(parents=True)
    save_file({k: v.astype(np.float32) for k, v in weights.items()}, directory / "model.safetensors")
    config = {
        "model_type": "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    }
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    shutil.copy(DATA / "qwen2.5_instruct.jinja", directory / "chat_template.jinja")
    return directory


def _answers(records: list[dict]) -> dict:
    """custom_id -> what the answer says (ids, timestamps and timings aside)."""
    out = {}
    for r in records:
        if r["error"] is not None:
            out[r["custom_id"]] = ("error", r["error"]["code"])
            continue
        body = r["response"]["body"]
        choice = body["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls", [])]
        out[r["custom_id"]] = (choice["finish_reason"], choice["message"]["content"], calls, body["usage"])
    return out


def test_two_processes_through_jax_distributed_answer_as_one(tmp_path: Path, qwen_tok):
    model = write_checkpoint(tmp_path / "tiny-qwen2", qwen_tok)
    messages = [{"role": "user", "content": f"Weather in city number {i}?"} for i in range(5)]
    calls = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    bodies = [{"messages": [m], "temperature": 0, "max_tokens": 96} | calls for m in messages]
    bodies[3] = {"messages": [messages[3]], "max_tokens": 12, "response_format": {"type": "json_object"}}
    lines = [{"custom_id": f"q{i}", "body": b} for i, b in enumerate(bodies)]
    lines.insert(2, {"custom_id": "bad", "body": {"messages": [], "max_tokens": 8}})
    inp = _write(tmp_path / "in.jsonl", lines)
    command = [sys.executable, "-m", "pask_jax.cli", "run", "-i", str(inp), "--model", str(model)]
    command += ["--method", "snapkv", "--budget", "0.5", "--max-batch", "2"]
    base = os.environ | {"JAX_PLATFORMS": "cpu"}
    port = free_port()
    runs = [  # (output, environment): one process; then process 0 (on a 1x2 mesh) and 1 of two
        (["-o", str(tmp_path / "one.jsonl")], base | {"PASK_JAX_CACHE": str(tmp_path / "cache-one")}),
    ] + [
        (
            ["-o", str(tmp_path / "two.jsonl")] + (["--mesh", "1x2"] if p == 0 else []),
            base
            | {
                "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(p),
                "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                "PASK_JAX_CACHE": str(tmp_path / f"cache-{p}"),
            },
        )
        for p in range(2)
    ]
    procs = [
        subprocess.Popen(command + args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args, env in runs
    ]
    results = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err), status in zip(procs, results, (1, 1, 0), strict=True):
        assert proc.returncode == status, err[-3000:]  # exit 1 where the bad line is: the single run and part 0
    one = _answers(_records(tmp_path / "one.jsonl"))
    parts = [_answers(_records(tmp_path / f"two.jsonl.{p}-of-2")) for p in range(2)]
    assert [sorted(part) for part in parts] == [["bad", "q0", "q3"], ["q1", "q2", "q4"]]  # line index mod 2
    assert parts[0] | parts[1] == one
    assert one["bad"] == ("error", "invalid_request")
    assert all(one[f"q{i}"][2] for i in (0, 1, 2, 4)) and one["q3"][0] in ("stop", "length")  # calls; JSON content

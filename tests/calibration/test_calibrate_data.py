"""`pask-jax calibrate --data`: a user's own requests (OpenAI Batch lines), checked, split by tool set, calibrated
against the model's own answers, resumable, and compiled into a policy that fits the model wherever it lies.

The model is a tiny random Qwen2-family checkpoint directory (tests/tiny_checkpoint.py: config.json, safetensors,
a byte-level tokenizer.json with Qwen's chat special tokens, Qwen2.5's chat template), so a request is a few hundred
tokens over a vocabulary of 264: the whole path runs in seconds. Tool schemas have bounded values (enums, booleans)
and one call per answer, so even a random model finishes its call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_checkpoint import write_model_dir

from pask_jax import cli
from pask_jax.calibration import run as calibration_run
from pask_jax.calibration.data import (
    CalibrationDataError,
    data_digest,
    prepare_requests,
    read_requests,
    split_requests,
)
from pask_jax.calibration.run import CalibrationStats, calibrate_requests

OPTIONS = dict(groups=2, levels=(0.0,), batch=16, progress=False)


def _tool(name: str, **properties) -> dict:
    parameters = {"type": "object", "properties": properties, "required": sorted(properties)}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": parameters}}


TOOL_SETS = {  # every call is 50 to 64 tokens long: one padded shape for the passes
    "weather": [_tool("weather", unit={"enum": ["c", "f"]}, city={"enum": ["Oslo", "Lima"]})],
    "alarm": [_tool("set_alarm", day={"enum": ["mon", "tue"]}, loud={"type": "boolean"})],
    "lights": [_tool("switch", room={"enum": ["hall", "bath"]}, on={"type": "boolean"})],
    "timer": [_tool("set_timer", minutes={"enum": [1, 5, 10]})],
    "music": [_tool("play_music", genre={"enum": ["jazz", "rock"]}), _tool("stop_music", now={"type": "boolean"})],
}


def batch_line(custom_id: str, tools: str, content: str) -> dict:
    body = {
        "messages": [{"role": "user", "content": content}],
        "tools": TOOL_SETS[tools],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 128,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_requests(path: Path, per_tool_set: int = 2) -> Path:
    """`per_tool_set` requests for each of the 5 tool sets, interleaved."""
    lines = [
        batch_line(f"{tools}-{i}", tools, f"Request {i} for the {tools} tool, please.")
        for i in range(per_tool_set)
        for tools in TOOL_SETS
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("checkpoint") / "tiny-qwen2")


# ---- reading and splitting ------------------------------------------------------------------------------------------


def test_bad_lines_are_named_before_the_model_loads(tmp_path: Path, capsys):
    good = json.dumps(batch_line("a", "weather", "Oslo?"))
    no_tools = batch_line("c", "weather", "hi")
    del no_tools["body"]["tools"], no_tools["body"]["tool_choice"]
    bad_choice = batch_line("e", "alarm", "wake me")
    bad_choice["body"]["tool_choice"] = {"type": "function", "function": {"name": "nope"}}
    no_id = {"method": "POST", "body": {}}
    lines = [good, "{not json", json.dumps(no_tools), json.dumps(no_id), json.dumps(bad_choice)]
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(CalibrationDataError) as info:
        read_requests(data)
    header, *named = str(info.value).splitlines()
    assert header.endswith("3 line(s) cannot be calibrated on:") and len(named) == 3
    assert named[0].startswith("line 2: is not JSON")
    assert named[1].startswith("line 4: has no custom_id")
    assert named[2].startswith("line 5 (custom_id 'e'): tool_choice names 'nope'")
    # the command refuses the file before it looks at the model (this one does not exist)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["calibrate", "--data", str(data), "--model", str(tmp_path / "no-model"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "line 5 (custom_id 'e')" in err and "no-model" not in err
    with pytest.raises(CalibrationDataError, match="does not exist"):
        read_requests(tmp_path / "missing.jsonl")
    # a request whose answer follows no grammar is valid but not calibration material: left out, with a warning
    json_answer = batch_line("d", "weather", "as JSON")
    del json_answer["body"]["tools"], json_answer["body"]["tool_choice"]
    json_answer["body"]["response_format"] = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    data.write_text("\n".join([good, json.dumps(no_tools), json.dumps(json_answer)]) + "\n")
    with pytest.warns(UserWarning, match=r"not calibrating on 1 request.*line 2 \(custom_id 'c'\)"):
        assert [r.custom_id for r in read_requests(data)] == ["a", "d"]
    data.write_text(json.dumps(no_tools) + "\n")
    with pytest.warns(UserWarning), pytest.raises(CalibrationDataError, match="no request with a structured answer"):
        read_requests(data)
    data.write_text("\n".join(lines) + "\n")
    # options that do not go with --data are refused before anything else
    for extra, expected in (
        (["--per-category", "2"], "for BFCL calibration"),
        (["--target", "canonical"], "for BFCL calibration"),
        (["--stats", str(data)], "give one of them"),
        (["--budgets", "0.2,1.5"], "every budget must be in"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["calibrate", "--data", str(data), "--out", str(tmp_path), *extra])
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err


def test_split_keeps_tool_sets_apart_and_is_deterministic(tmp_path: Path):
    requests = read_requests(write_requests(tmp_path / "requests.jsonl", per_tool_set=4))  # 20 requests, 5 tool sets
    split = split_requests(requests, 0.2)
    calibration_sets, dev_sets = ({r.tool_set for r in part} for part in (split.calibration, split.dev))
    assert calibration_sets.isdisjoint(dev_sets) and len(calibration_sets | dev_sets) == 5
    assert len(split.dev) == 4 and len(split.calibration) == 16  # one tool set of 4 requests: exactly 20 %
    assert [r.line for r in split.calibration] == sorted(r.line for r in split.calibration)  # the file's order
    # the file's order does not matter, nor do tool descriptions or the order of tools
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()[::-1]
    (tmp_path / "reversed.jsonl").write_text("\n".join(lines) + "\n")
    again = split_requests(read_requests(tmp_path / "reversed.jsonl"), 0.2)
    assert {r.custom_id for r in again.dev} == {r.custom_id for r in split.dev}
    music = next(r for r in requests if r.custom_id == "music-0")
    reworded = json.loads(json.dumps(batch_line("x", "music", "hi")))
    reworded["body"]["tools"] = reworded["body"]["tools"][::-1]
    reworded["body"]["tools"][0]["function"]["description"] = "another text"
    (tmp_path / "one.jsonl").write_text(json.dumps(reworded) + "\n")
    assert read_requests(tmp_path / "one.jsonl")[0].tool_set == music.tool_set
    reworded["body"]["tools"][0]["function"]["parameters"]["properties"]["now"] = {"type": "integer"}
    (tmp_path / "one.jsonl").write_text(json.dumps(reworded) + "\n")
    assert read_requests(tmp_path / "one.jsonl")[0].tool_set != music.tool_set
    # a larger fraction takes more tool sets; 0 takes none; both parts always keep at least one
    assert len(split_requests(requests, 0.5).dev) == 8
    assert not split_requests(requests, 0.0).dev and len(split_requests(requests, 0.0).calibration) == 20
    assert len(split_requests(requests, 0.01).dev) == 4 and split_requests(requests, 0.99).calibration
    with pytest.raises(CalibrationDataError, match="dev_fraction=1.0"):
        split_requests(requests, 1.0)
    with pytest.raises(CalibrationDataError, match="share one tool set.*--dev-fraction 0"):
        split_requests([r for r in requests if r.custom_id.startswith("timer")], 0.2)


# ---- calibrating --------------------------------------------------------------------------------------------------


def _prepared(model_dir: Path, data: Path):
    from pask_jax.llm import LLM

    llm = LLM(model_dir, method="full")
    split = split_requests(read_requests(data), 0.2)
    return llm, split, prepare_requests(llm.builder, split.calibration, data)


def _same(a: CalibrationStats, b: CalibrationStats) -> None:
    for key, value in vars(a).items():
        if key != "wall_s":
            np.testing.assert_array_equal(value, getattr(b, key), err_msg=key)


def test_interrupted_run_resumes_to_identical_statistics(model_dir: Path, tmp_path: Path, monkeypatch):
    llm, split, prepared = _prepared(model_dir, write_requests(tmp_path / "requests.jsonl"))
    assert len(prepared) == 8 and split.tool_sets("calibration") == 4
    prepared, digest = prepared[:4], data_digest(split.calibration[:4])  # one request per tool set
    whole = calibrate_requests(llm.model, llm.tokenizer, prepared, data=digest, **OPTIONS)
    assert whole.target == "own" and whole.n_items == 4 and not whole.skipped  # every own call finished
    assert whole.item_ids == [custom_id for custom_id, _ in prepared]
    assert (whole.distortion[whole.present > 0] > 0).any()

    answered, real_own_call, kill = [], calibration_run.own_call, {"at": 2}  # killed answering the third request

    def own_call(engine, prompt, *args):
        if len(answered) == kill["at"]:
            raise KeyboardInterrupt
        answered.append(tuple(prompt.tolist()))
        return real_own_call(engine, prompt, *args)

    monkeypatch.setattr(calibration_run, "own_call", own_call)
    checkpoint = tmp_path / "checkpoint"
    with pytest.raises(KeyboardInterrupt):
        calibrate_requests(
            llm.model, llm.tokenizer, prepared, data=digest, checkpoint_dir=checkpoint, save_every=1, **OPTIONS
        )
    kill["at"] = None
    resumed = calibrate_requests(llm.model, llm.tokenizer, prepared, data=digest, checkpoint_dir=checkpoint, **OPTIONS)
    assert len(answered) == len(set(answered)) == 4  # 2 before the interruption, 2 after it: none answered twice
    _same(resumed, whole)
    with pytest.raises(ValueError, match="checkpoint .* is for"):  # other data: refused, not mixed in
        calibrate_requests(llm.model, llm.tokenizer, prepared, data="other", checkpoint_dir=checkpoint, **OPTIONS)
    with pytest.raises(ValueError, match="holds 2 items this run does not calibrate"):
        calibrate_requests(llm.model, llm.tokenizer, prepared[2:], data=digest, checkpoint_dir=checkpoint, **OPTIONS)


# ---- the command, and the policy it writes --------------------------------------------------------------------------


def calibrate_command(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """`pask-jax calibrate --data` as a user runs it, at the tiny model's size (2 groups, keep level 0 only)."""
    sizes = ["--groups", "2", "--levels", "0", "--budgets", "0.5"]
    return ["calibrate", "--model", str(model_dir), "--data", str(data), "--out", str(out), *sizes, *extra]


def test_calibrate_command_resumes_and_its_policy_survives_moves(model_dir: Path, tmp_path: Path, capsys):
    from pask_jax import load_tokenizer
    from pask_jax.batch_file import read_input, run_batch
    from pask_jax.llm import LLM
    from pask_jax.models.loading import load_config
    from pask_jax.policy import ModelFingerprint, PersistencePolicy

    copied_model = shutil.copytree(model_dir, tmp_path / "models" / "tiny-qwen2")
    data = write_requests(tmp_path / "requests.jsonl", per_tool_set=1)
    out, progress = tmp_path / "policy", tmp_path / "progress"
    for extra in (["--max-items", "2"], []):  # stopped after 2 items, then continued with the same --checkpoint
        with pytest.raises(SystemExit) as exit_info:
            cli.main(calibrate_command(copied_model, data, out, "--checkpoint", str(progress), *extra))
        assert exit_info.value.code == 0
        printed = capsys.readouterr().out
        assert f"{2 if extra else 4} items calibrated" in printed
    assert f"pask-jax run -i {out / 'dev.jsonl'}" in printed and f"--policy {out}" in printed
    stats = CalibrationStats.load(out / "stats.json")
    split = json.loads((out / "split.json").read_text())
    assert stats.item_ids == split["calibration"] and len(split["calibration"]) == 4 and len(split["dev"]) == 1
    assert split["tool_sets"] == {"calibration": 4, "dev": 1}
    dev = read_input(out / "dev.jsonl")
    assert [line.custom_id for line in dev] == split["dev"] and all(line.error is None for line in dev)

    # Nothing in the policy depends on where the model or the policy lie: move and rename both.
    model = shutil.move(copied_model, tmp_path / "elsewhere" / "my-model")
    policy_dir = shutil.move(out, tmp_path / "elsewhere" / "my-policy")
    policy = PersistencePolicy.load(policy_dir)
    assert policy.fits == ModelFingerprint.of(load_config(model), load_tokenizer(model))
    assert [t.budget for t in policy.tables] == [0.5]
    # ...and it answers a budget it was not compiled for, on the dev part, as the printed commands run it
    llm = LLM(model, method="pask", budget=0.27, policy=policy_dir)
    assert llm.policy.content_hash() == policy.content_hash() and llm.policy.table(0.27).budget == 0.27
    summary = run_batch(lambda: llm, Path(policy_dir) / "dev.jsonl", tmp_path / "dev_pask.jsonl")
    assert summary.completed == 1 and not summary.failed and summary.kept_ratios[0] <= 0.27 + 0.01  # the budget
    # recompiling from the policy's statistics for that budget gives the table it compiled on load
    recompile = ["calibrate", "--model", str(model), "--stats", str(policy_dir), "--budgets", "0.27"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*recompile, "--out", str(tmp_path / "at-0.27")])
    assert exit_info.value.code == 0
    recompiled = PersistencePolicy.load(tmp_path / "at-0.27").table(0.27)
    for field in ("floor", "priority", "retain", "group_fractions"):
        np.testing.assert_array_equal(getattr(recompiled, field), getattr(llm.policy.table(0.27), field))

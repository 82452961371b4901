"""Needle in a haystack: needle placement and prompt length, needles, the scorer, a run on a tiny model (json answers
obey the schema, results resume), settings checks, the CLI's validation and the plots."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import synthetic_stats

from pask_jax import cli
from pask_jax.arguments import PROTOCOL_GRAMMAR_BACKEND
from pask_jax.calibration.compiler import compile_policy
from pask_jax.experiments import commands, niah
from pask_jax.experiments.bench.machine import write_json
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.policy import PersistencePolicy
from pask_jax.requests import RequestBuilder
from pask_jax.structure import Role

DATA = Path(__file__).parents[1] / "data"
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def builder(qwen_tok) -> RequestBuilder:
    template = ChatTemplate((DATA / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>", name="qwen2.5")
    return RequestBuilder(qwen_tok, template, grammar_backend=PROTOCOL_GRAMMAR_BACKEND)  # as the experiment's


def _haystack_without_needle(prompt: niah.NiahPrompt) -> str:
    content = prompt.messages[0]["content"]
    haystack = content[len(niah.INSTRUCTION) + 1 : content.rindex("\n")]
    sentence = prompt.needle.sentence
    if haystack.startswith(sentence + " "):
        return haystack[len(sentence) + 1 :]
    return haystack.replace(" " + sentence, "")


@pytest.mark.parametrize("haystack", niah.HAYSTACKS)
def test_the_needle_sits_at_the_sentence_boundary_nearest_each_depth(builder, qwen_tok, haystack):
    offsets = []
    for depth in niah.DEFAULT_DEPTHS:
        prompt = niah.build_prompt(builder, 256, depth, haystack, json_answer=False)
        content = prompt.messages[0]["content"]
        assert content.count(prompt.needle.sentence) == 1
        target = depth / 100 * prompt.haystack_tokens
        assert abs(prompt.needle_token - target) <= prompt.sentence_tokens  # within one sentence of the depth
        # Independently: the haystack alone, tokenized, and its sentence boundaries (in tokens).
        alone = _haystack_without_needle(prompt)
        encoding = qwen_tok.backend.encode(alone, add_special_tokens=False)
        starts = [start for start, _ in encoding.offsets]
        chars = [0, *(m.start() for m in re.finditer(r" (?=\S)", alone) if alone[m.start() - 1] in ".!?")]
        boundaries = [sum(s < c for s in starts) for c in chars] + [len(starts)]
        assert abs(len(starts) - prompt.haystack_tokens) <= 1
        nearest = min(abs(b - target) for b in boundaries)
        assert abs(prompt.needle_token - target) <= nearest + 1  # no boundary is nearer (one token of edge effects)
        before = content[: content.index(prompt.needle.sentence)]
        assert before.endswith((". ", "? ", "! ", niah.INSTRUCTION + "\n"))  # at a sentence boundary
        offsets.append(prompt.needle_token)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert prompt.needle_token == prompt.haystack_tokens  # depth 100: after the last sentence
    assert prompt.messages[0]["content"].endswith(prompt.needle.sentence + "\n" + prompt.needle.question)


@pytest.mark.parametrize("haystack", niah.HAYSTACKS)
@pytest.mark.parametrize("length", [128, 256, 1024])
def test_the_prompt_fills_its_length_to_within_a_sentence(builder, haystack, length):
    for depth in (0.0, 50.0, 100.0):
        prompt = niah.build_prompt(builder, length, depth, haystack, json_answer=False)
        assert length - prompt.sentence_tokens - 1 <= len(prompt.prepared.ids) <= length
        assert prompt.prepared.ids == builder.tokenizer.encode(prompt.prepared.text)
        roles = prompt.prepared.roles  # PASK's prompt roles: the whole message (haystack, needle) is the user's
        assert len(roles) == len(prompt.prepared.ids) and roles[0] == Role.SINK
        assert sum(r == Role.REQUEST_TEXT for r in roles) > prompt.haystack_tokens


def test_a_length_without_room_for_a_haystack_is_refused(builder):
    with pytest.raises(niah.NiahError, match="no room"):
        niah.build_prompt(builder, 60, 50.0, "noise", json_answer=False)


def test_needles_are_deterministic_and_well_formed(builder):
    assert niah.make_needle(3, 2048, 40.0, "prose") == niah.make_needle(3, 2048, 40.0, "prose")
    needles = [niah.make_needle(seed, 2048, 40.0, "prose") for seed in range(50)]
    assert len({n.number for n in needles}) == 50 and len({n.key for n in needles}) > 25
    for needle in needles:
        assert re.fullmatch(r"[1-9][0-9]{6}", needle.number)
        assert re.fullmatch(r"[a-z]+-[a-z]+", needle.key)
    cells = {niah.make_needle(0, n, d, h) for n in (2048, 4096) for d in (0.0, 10.0) for h in niah.HAYSTACKS}
    assert len(cells) == 8  # every prompt of a run has its own needle
    first = niah.build_prompt(builder, 192, 30.0, "noise", seed=7, json_answer=False)
    again = niah.build_prompt(builder, 192, 30.0, "noise", seed=7, json_answer=False)
    assert first.prepared.ids == again.prepared.ids and first.needle == again.needle


def test_prose_is_plain_sentences_without_numbers():
    sentences = niah.prose_sentences()
    assert len(sentences) > 500  # enough for ~25k tokens before it cycles
    assert all(20 <= len(s) <= niah.PROSE_MAX_CHARS and s[-1] in ".!?" for s in sentences)
    assert not any(re.search(r"\d", s) or "magic number" in s for s in sentences)
    assert niah.haystack_sentence("noise", 7) == niah.NOISE_SENTENCES[2]


@pytest.mark.parametrize(
    ("text", "mode", "read", "correct"),
    [
        ("The special magic number for calm-river is 1234567.", "free", "1234567", True),
        ("1234567", "free", "1234567", True),
        ("It is 7654321, not 1234567.", "free", "7654321", False),  # the first number counts
        ("I could not find it.", "free", None, False),
        ("12345678", "free", None, False),  # eight digits are not the number
        ('{"number": "1234567"}', "json", "1234567", True),
        ('{ "number" : "7654321" }', "json", "7654321", False),
        ('{"number": "12345"}', "json", None, False),
        ('{"number": "1234567", "x": 1}', "json", None, False),
        ('{"number": "12345', "json", None, False),  # cut off
        ("1234567", "json", None, False),  # not the json answer
    ],
)
def test_the_scorer_reads_exactly_seven_digits(text, mode, read, correct):
    assert niah.score_answer(text, "1234567", mode) == (read, correct)


def _schema_answer(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"number"} and re.fullmatch(r"[0-9]{7}", value["number"]) is not None


def test_a_run_answers_every_cell_obeys_the_json_schema_and_resumes(
    builder, tiny_qwen_vocab, qwen_tok, tmp_path, monkeypatch
):
    calls = []
    real = niah.generate_shared

    def counting(engines, prompts, *args, **kwargs):
        calls.append((len(engines), len(prompts)))
        return real(engines, prompts, *args, **kwargs)

    monkeypatch.setattr(niah, "generate_shared", counting)
    cfg = niah.NiahConfig(
        methods=("full", "dapq", "pask"), budgets=(0.1,), lengths=(192,), depths=(0.0, 100.0), haystacks=("noise",),
        batch_size=1,
    )  # fmt: skip
    prompts = niah.build_prompts(builder, cfg)
    out = tmp_path / "niah.json"
    options = dict(model_name="tiny", template_name="qwen2.5", out=out)
    result = niah.run_niah(tiny_qwen_vocab, qwen_tok, prompts, cfg, **options)
    assert calls == [(6, 1), (6, 1)]  # one shared prefill per prompt for 3 engines x 2 modes
    cells = result["cells"]
    assert len(cells) == 3 * 2 * 2 and len({niah.cell_key(c) for c in cells}) == 12
    for cell in cells:
        assert (cell["read"], cell["correct"]) == niah.score_answer(cell["answer"], cell["number"], cell["mode"])
        if cell["mode"] == "json":
            assert _schema_answer(cell["answer"]), cell
        if cell["method"] == "full":
            assert cell["budget"] == 1.0 and cell["kept_ratio_max"] == 1.0
        else:
            assert cell["kept_ratio_max"] <= 0.1 + 0.02  # the budget plus the token being written
        assert cell["ttft_s"] > 0 and cell["decode_s"] >= 0
    assert json.loads(out.read_text()) == result
    rows = {(s["method"], s["mode"]): s for s in result["summary"]}
    assert rows[("dapq", "json")]["n"] == 2 and set(rows) == {(m, x) for m in cfg.methods for x in cfg.modes}
    assert "| dapq | 0.1 |" in niah.format_table(result)

    again = niah.run_niah(tiny_qwen_vocab, qwen_tok, prompts, cfg, **options)
    assert len(calls) == 2 and again["cells"] == cells  # nothing new computed

    wider = dataclasses.replace(cfg, depths=(0.0, 50.0, 100.0))
    grown = niah.run_niah(tiny_qwen_vocab, qwen_tok, niah.build_prompts(builder, wider), wider, **options)
    assert calls[2:] == [(6, 1)]  # only the new depth's prompt
    assert grown["cells"][:12] == cells and {c["depth"] for c in grown["cells"][12:]} == {50.0}


def test_a_results_file_of_other_settings_is_refused(tmp_path):
    cfg = niah.NiahConfig(methods=("full", "dapq"), lengths=(256,))
    config = niah.run_config(cfg, "m", "t", {"dapq": {"num_pseudo": 32}}, {})
    path = tmp_path / "r.json"
    write_json(path, {"model": "m", "config": config, "cells": [], "summary": []})
    assert niah.read_results(path, config) == ([], config["settings"])
    more = dataclasses.replace(cfg, methods=("h2o",))  # another method joins; the file's specs stay recorded
    cells, settings = niah.read_results(path, niah.run_config(more, "m", "t", {"dapq": {"num_pseudo": 32}}, {}))
    assert cells == [] and set(settings) == {"full", "dapq", "h2o"}
    with pytest.raises(niah.NiahError, match="seed"):
        niah.read_results(path, niah.run_config(dataclasses.replace(cfg, seed=1), "m", "t", {}, {}))
    with pytest.raises(niah.NiahError, match="'dapq' ran there"):
        niah.read_results(path, niah.run_config(cfg, "m", "t", {"dapq": {"num_pseudo": 8}}, {}))
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(niah.NiahError, match="not a needle"):
        niah.read_results(tmp_path / "junk.json", config)


def test_a_policy_must_answer_every_budget():
    compiled = compile_policy(synthetic_stats(num_layers=2, groups=2), [0.1, 0.5])
    # its tables alone, without the statistics to compile other budgets from
    policy = PersistencePolicy(compiled.model, compiled.num_layers, groups=compiled.groups, tables=compiled.tables)
    niah.check_methods(niah.NiahConfig(methods=("pask:calibrated",), budgets=(0.1, 0.5)), {}, {"calibrated": policy})
    with pytest.raises(niah.NiahError, match="no policy table for budget 0.03"):
        niah.check_methods(
            niah.NiahConfig(methods=("pask:calibrated",), budgets=(0.03, 0.1)), {}, {"calibrated": policy}
        )
    with pytest.raises(niah.NiahError, match="a label must name"):
        niah.check_methods(niah.NiahConfig(methods=("pask:other",)), {}, {"calibrated": policy})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--depths", "0,120"], "depth 120"),
        (["--depths", "0,half"], "depth 'half' is not a number"),
        (["--lengths", "2k,0"], "length 0"),
        (["--lengths", "2x"], "length '2x'"),
        (["--lengths", "64k"], "length 65536"),
        (["--budgets", "0,0.1"], "budget 0.0"),
        (["--budgets", "1.5"], "budget 1.5"),
        (["--budgets", "0.1,,0.2"], "empty entry"),
        (["--modes", "xml"], "answer mode 'xml'"),
        (["--haystacks", "essays"], "haystack 'essays'"),
        (["--methods", "full,magic"], "unknown method 'magic'"),
        (["--max-new-tokens", "16"], "json answer may need 25"),
        (["--policy", "calibrated=none"], "none is for plain pask"),
    ],
)
def test_the_cli_refuses_bad_settings_before_the_model_loads(flags, message, tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was resolved before the settings were checked")

    monkeypatch.setattr("pask_jax.models.fetch.resolve_model_path", no_model)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["niah", "--out", str(tmp_path / "r.json"), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_defaults_are_the_module_defaults(monkeypatch):
    seen = []
    monkeypatch.setattr(commands, "cmd_niah", seen.append)
    with pytest.raises(SystemExit):
        cli.main(["niah", "--out", "r.json"])
    [args] = seen
    assert niah.parse_names(args.methods, "methods") == niah.DEFAULT_METHODS
    assert niah.parse_floats(args.budgets, "budget") == niah.DEFAULT_BUDGETS
    assert niah.parse_lengths(args.lengths) == niah.DEFAULT_LENGTHS
    assert niah.parse_floats(args.depths, "depth") == niah.DEFAULT_DEPTHS
    assert (niah.parse_names(args.haystacks, "h"), niah.parse_names(args.modes, "m")) == (niah.HAYSTACKS, niah.MODES)
    assert args.max_new_tokens == niah.DEFAULT_MAX_NEW_TOKENS


def test_the_plots_are_written_beside_the_results(tmp_path):
    from tools import plot_niah as plot

    rng = np.random.default_rng(0)
    cells = [
        {
            "method": m,
            "budget": b,
            "length": n,
            "depth": d,
            "haystack": "noise",
            "mode": x,
            "correct": bool(rng.random() < 0.5),
        }
        for m, budgets in (("full", (1.0,)), ("dapq", (0.03, 0.1)), ("snapkv", (0.03, 0.1)))
        for b in budgets
        for n in (2048, 4096)
        for d in (0.0, 50.0, 100.0)
        for x in ("free", "json")
    ]
    path = tmp_path / "niah.json"
    path.write_text(json.dumps({"model": "tiny", "cells": cells}))
    written = plot.main([str(path)])
    names = sorted(p.name for p in written)
    assert names == sorted(
        [f"niah_heatmap_b{b}_noise_{x}.png" for b in ("0.03", "0.1") for x in ("free", "json")]
        + ["niah_accuracy_vs_budget.png"]
    )
    assert all(p.stat().st_size > 1000 for p in written)

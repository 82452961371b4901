"""The long-output records workload: seeded items and their splits, the gold answer's schema and length, the exact
scorer, a run on a tiny model (grammar-constrained answers, resume, settings checks) and the CLI's front door."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from pask_jax import cli
from pask_jax.arguments import PROTOCOL_GRAMMAR_BACKEND
from pask_jax.experiments import commands, records
from pask_jax.experiments.bench.machine import write_json
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.requests import RequestBuilder
from pask_jax.structure import Role

DATA = Path(__file__).parents[1] / "data"
SHORT = 34  # dev items 34 and 35 have the shortest prompts near the start (7 and 8 records, one length bucket)


@pytest.fixture(scope="module")
def builder(qwen_tok) -> RequestBuilder:
    template = ChatTemplate((DATA / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>", name="qwen2.5")
    return RequestBuilder(qwen_tok, template, grammar_backend=PROTOCOL_GRAMMAR_BACKEND)  # as the experiment's


def test_items_are_a_function_of_their_seed_and_the_splits_never_meet():
    first, again = records.make_item("dev", 5), records.make_item("dev", 5)
    assert (first.records, first.sentences, first.company) == (again.records, again.sentences, again.company)
    dev = [records.make_item("dev", i) for i in range(30)]
    evaluation = [records.make_item("evaluation", i) for i in range(30)]
    assert len({item.document for item in dev + evaluation}) == 60  # every item its own manifest
    dev_ids = {r["id"] for item in dev for r in item.records}
    eval_ids = {r["id"] for item in evaluation for r in item.records}
    assert len(dev_ids & eval_ids) < 0.05 * len(dev_ids)  # ids are drawn apart (a few collide by chance)
    assert records.item_seed("dev", records.SPLIT_SIZE - 1) < records.item_seed("evaluation", 0)
    with pytest.raises(records.RecordsError, match="outside its split"):
        records.item_seed("dev", records.SPLIT_SIZE)
    with pytest.raises(records.RecordsError, match="unknown split 'test'"):
        records.make_item("test", 0)


@pytest.mark.parametrize("split", records.SPLITS)
def test_the_manifest_writes_every_record_and_its_gold_obeys_the_schema(split):
    for index in range(40):
        item = records.make_item(split, index)
        assert records.MIN_RECORDS <= len(item.records) <= records.MAX_RECORDS
        records._VALIDATOR.validate(item.gold)  # formats checked: the dates are real dates
        assert records.score_answer(records.gold_text(item), item.records).exact
        written = [records.record_sentence(r, t) for r in item.records for t in range(len(records.TEMPLATES))]
        record_sentences = [s for s in item.sentences if s in written]
        assert len(record_sentences) == len(item.records)  # one per record, in order ...
        assert all(r["id"] in s for r, s in zip(item.records, record_sentences, strict=True))
        distractors = [s for s in item.sentences if s not in written]
        assert len(distractors) == len(item.records) // 3 and set(distractors) <= set(records.DISTRACTORS)
        assert item.sentences[0] in record_sentences  # ... and the first sentence is a record's
        assert len({r["id"] for r in item.records}) == len(item.records)
        dates = [r["ship_date"] for r in item.records]
        assert dates == sorted(dates)


def test_a_record_sentence_spells_out_every_field():
    record = {
        "id": "SH-12345", "goods": "desk lamps", "quantity": 12, "weight_kg": 31.0, "status": "in_transit",
        "fragile": True, "ship_date": "2024-03-05", "recipient": "Maria Lopez",
        "destination": {"city": "Quebec City", "country": "Canada"},
    }  # fmt: skip
    assert records.record_sentence(record, 0) == (
        "Shipment SH-12345 carries 12 desk lamps (31.0 kg) to Maria Lopez in Quebec City, Canada. It left on March 5, "
        "2024, is marked fragile, and is in transit."
    )


@pytest.mark.parametrize("split", records.SPLITS)
def test_gold_answers_take_512_to_2048_tokens(qwen_tok, split):
    spaced, compact = [], []
    for index in range(100):
        gold = records.make_item(split, index).gold
        spaced.append(len(qwen_tok.encode(json.dumps(gold))))
        compact.append(len(qwen_tok.encode(json.dumps(gold, separators=(",", ":")))))
    assert min(compact) >= 512 and max(spaced) <= 2048
    assert max(spaced) > 1800 and min(compact) < 700  # the range is used, not only its middle
    assert max(spaced) + 1 <= records.DEFAULT_MAX_NEW_TOKENS  # and the end of turn fits


GOLD = records.make_item("dev", 0).records


def _answer(rows, **extra) -> str:
    return json.dumps({"records": list(rows), **extra})


def _changed(index: int, **fields) -> list[dict]:
    rows = copy.deepcopy(list(GOLD))
    rows[index].update(fields)
    return rows


N = len(GOLD)


@pytest.mark.parametrize(
    ("text", "valid", "schema_valid", "given", "correct", "exact"),
    [
        (_answer(GOLD), True, True, N, N, True),
        (json.dumps({"records": list(GOLD)}, separators=(",", ":")), True, True, N, N, True),
        (_answer(_changed(0, weight_kg=int(GOLD[0]["weight_kg"]) + 1.0)), True, True, N, N - 1, False),
        (_answer(_changed(2, fragile=int(GOLD[2]["fragile"]))), True, False, N, N - 1, False),  # 1 is not true
        (_answer(_changed(1, quantity=str(GOLD[1]["quantity"]))), True, False, N, N - 1, False),
        (_answer(_changed(1, goods=f"{GOLD[1]['quantity']} {GOLD[1]['goods']}")), True, False, N, N - 1, False),
        (
            _answer(_changed(3, destination={"city": GOLD[3]["destination"]["city"], "country": "Mars"})),
            True,
            True,
            N,
            N - 1,
            False,
        ),  # fmt: skip
        (_answer(_changed(4, ship_date="2024-02-30")), True, False, N, N - 1, False),  # not a date
        (_answer(GOLD[:2] + GOLD[3:]), True, True, N - 1, N - 1, False),  # a record skipped costs itself alone
        (_answer([*GOLD, GOLD[0]]), True, True, N + 1, N, False),  # an extra record
        (_answer(GOLD[1:] + GOLD[:1]), True, True, N, N - 1, False),  # out of order: the first one is lost
        (_answer(GOLD, note="x"), True, False, N, N, False),  # all records right, but an extra key
        (_answer([]), True, True, 0, 0, False),
        (_answer(GOLD)[:-40], False, False, N - 1, N - 1, False),  # cut at the token limit: its whole records count
        (json.dumps(list(GOLD)), True, False, 0, 0, False),  # an array, not the answer object
    ],
)
def test_the_scorer_is_exact_and_matches_records_in_order(text, valid, schema_valid, given, correct, exact):
    score = records.score_answer(text, GOLD)
    assert (score.valid_json, score.schema_valid, score.answer_records, score.correct_records) == (
        valid, schema_valid, given, correct,
    )  # fmt: skip
    assert score.exact == exact and score.gold_records == N
    assert score.recall == pytest.approx(correct / N)
    assert score.precision == pytest.approx(correct / given if given else 0.0)
    p, r = score.precision, score.recall
    assert score.f1 == pytest.approx(2 * p * r / (p + r) if p + r else 0.0)


FIELDS = sum(len(records.leaf_fields(r)) for r in GOLD)  # 10 per record: the destination's city and country apart


@pytest.mark.parametrize(
    ("answer", "correct_fields"),
    [
        (GOLD, FIELDS),
        (_changed(0, weight_kg=GOLD[0]["weight_kg"] + 1), FIELDS - 1),  # one field wrong: the record's others count
        (_changed(3, destination={"city": GOLD[3]["destination"]["city"], "country": "Mars"}), FIELDS - 1),
        (GOLD[1:] + GOLD[:1], FIELDS),  # matched by id, not position
        (_changed(2, id="SH-00000"), FIELDS - 10),  # an id nobody has: that record's fields are lost
        ([*GOLD, GOLD[0]], FIELDS),  # a repeated record adds fields, not matches
    ],
)
def test_fields_are_scored_per_record_by_id(answer, correct_fields):
    score = records.score_answer(_answer(answer), GOLD)
    assert (score.correct_fields, score.gold_fields) == (correct_fields, FIELDS)
    written = sum(len(records.leaf_fields(r)) for r in answer)
    assert score.field_f1 == pytest.approx(2 * correct_fields / (written + FIELDS))


def test_in_order_matching_is_the_longest_common_subsequence():
    assert records.matched_in_order([1, 2, 3, 4], [1, 3, 4, 2]) == 3
    assert records.matched_in_order([4, 3, 2, 1], [1, 2, 3, 4]) == 1
    assert records.matched_in_order([], [1, 2]) == 0
    assert records.matched_in_order([1.0, True], [1, 1]) == 1  # numbers by value, booleans only as booleans
    assert records.same_value({"a": 1, "b": {"c": 2.0}}, {"b": {"c": 2}, "a": 1})
    assert not records.same_value({"a": 1}, {"a": 1, "b": 2})


def test_a_prompt_is_the_chat_templates_with_prompt_roles_and_the_answer_grammar(builder):
    prompt = records.build_prompt(builder, records.make_item("dev", SHORT), max_new_tokens=64)
    item = prompt.item
    assert prompt.prepared.request.messages[0]["content"] == item.prompt
    assert item.prompt.startswith(records.INSTRUCTION) and item.prompt.endswith(item.sentences[-1])
    assert prompt.prepared.grammar is not None and prompt.prepared.grammar.kind == "json"
    roles = prompt.prepared.roles
    assert len(roles) == len(prompt.prepared.ids) and roles[0] == Role.SINK
    assert sum(r == Role.REQUEST_TEXT for r in roles) > len(builder.tokenizer.encode(item.document)) - 5
    assert prompt.gold_tokens == len(builder.tokenizer.encode(records.gold_text(item)))


def test_a_run_scores_every_cell_and_resumes(builder, tiny_qwen_vocab, qwen_tok, tmp_path, monkeypatch):
    calls = []
    real = records.generate_shared

    def counting(engines, prompts, *args, **kwargs):
        calls.append((len(engines), len(prompts)))
        return real(engines, prompts, *args, **kwargs)

    monkeypatch.setattr(records, "generate_shared", counting)
    methods = ("full", "snapkv", "pask", "kivi", "h2o@int8")  # int4 needs head_dim 32: the tiny model's is 16
    cfg = records.RecordsConfig(
        methods=methods, budgets=(0.33,), items=1, offset=SHORT, batch_size=1, max_new_tokens=24
    )
    out = tmp_path / "records.json"
    options = dict(model_name="tiny", template_name="qwen2.5", out=out)
    result = records.run_records(tiny_qwen_vocab, qwen_tok, records.build_prompts(builder, cfg), cfg, **options)
    assert calls == [(5, 1)]  # one shared prefill for the five engines
    cells = result["cells"]
    assert [records.cell_key(c) for c in cells] == [(m, 1.0 if m == "full" else 0.33, SHORT) for m in methods]
    gold = records.make_item("dev", SHORT).records
    for cell in cells:
        score = records.score_answer(cell["answer"], gold)
        assert (cell["valid_json"], cell["correct_records"], cell["exact"]) == (
            score.valid_json, score.correct_records, score.exact,
        )  # fmt: skip
        assert cell["answer"].startswith("{") and cell["generated_tokens"] <= 24  # under the answer's grammar
        assert cell["valid_json"] == (cell["finish_reason"] == "stop")  # cut off: the JSON is not finished
        assert cell["gold_records"] == len(gold) and cell["gold_tokens"] > 512
        if cell["method"] == "full":
            assert cell["budget"] == 1.0 and cell["kept_ratio_max"] == 1.0
        else:
            assert cell["kv_bytes_ratio_max"] <= 0.33 + 0.02  # the budget plus the token being written
    assert json.loads(out.read_text()) == result
    assert [s["method"] for s in result["summary"]] == ["full", "snapkv", "h2o@int8", "kivi", "pask"]
    snapkv = result["summary"][1]
    assert snapkv["tpot_ms"] == pytest.approx(1e3 * cells[1]["decode_s"] / cells[1]["generated_tokens"])
    assert "| snapkv | 0.33 | 1 |" in records.format_table(result)

    again = records.run_records(tiny_qwen_vocab, qwen_tok, records.build_prompts(builder, cfg), cfg, **options)
    assert calls == [(5, 1)] and again["cells"] == cells  # nothing new computed

    more = dataclasses.replace(cfg, items=2)
    grown = records.run_records(tiny_qwen_vocab, qwen_tok, records.build_prompts(builder, more), more, **options)
    assert calls[1:] == [(5, 1)]  # only the new item
    assert grown["cells"][:5] == cells and {c["index"] for c in grown["cells"][5:]} == {SHORT + 1}


def test_a_results_file_of_other_settings_is_refused(tmp_path):
    cfg = records.RecordsConfig(methods=("full", "snapkv"), items=2)
    config = records.run_config(cfg, "m", "t", {"snapkv": {"window": 32}}, {})
    path = tmp_path / "r.json"
    write_json(path, {"model": "m", "config": config, "cells": [], "summary": []})
    assert records.read_results(path, config, "records") == ([], config["settings"])
    wider = dataclasses.replace(cfg, items=5, offset=3, methods=("h2o",))  # more items, another method: resumes
    assert records.read_results(path, records.run_config(wider, "m", "t", {}, {}), "records")[0] == []
    for other, differs in (({"split": "evaluation"}, "split"), ({"max_new_tokens": 512}, "max_new_tokens")):
        with pytest.raises(ValueError, match=differs):
            records.read_results(path, records.run_config(dataclasses.replace(cfg, **other), "m", "t", {}, {}))
    with pytest.raises(ValueError, match="'snapkv' ran there"):
        records.read_results(path, records.run_config(cfg, "m", "t", {"snapkv": {"window": 8}}, {}), "records")
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a records results file"):
        records.read_results(tmp_path / "junk.json", config, "records")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--split", "test"], "invalid choice: 'test'"),
        (["--items", "0"], "items=0 from offset=0"),
        (["--offset", "-1"], "offset=-1"),
        (["--offset", "999999", "--items", "2"], "within the split's items 0..999999"),
        (["--budgets", "0,0.1"], "budget 0.0"),
        (["--budgets", "0.1,0.1"], "lists a value twice"),
        (["--budgets", "0.1,,0.2"], "empty entry"),
        (["--methods", "full,magic"], "unknown method 'magic'"),
        (["--methods", "snapkv@int3"], "unknown storage 'int3'"),
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--batch-size", "0"], "batch_size=0"),
        (["--policy", "calibrated=none"], "none is for plain pask"),
    ],
)
def test_the_cli_refuses_bad_settings_before_the_model_loads(flags, message, tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was resolved before the settings were checked")

    monkeypatch.setattr("pask_jax.models.fetch.resolve_model_path", no_model)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["records", "--out", str(tmp_path / "r.json"), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_defaults_are_the_module_defaults(monkeypatch):
    seen = []
    monkeypatch.setattr(commands, "cmd_records", seen.append)
    with pytest.raises(SystemExit):
        cli.main(["records", "--out", "r.json"])
    [args] = seen
    defaults = records.RecordsConfig()
    assert tuple(args.methods.split(",")) == defaults.methods == records.DEFAULT_METHODS
    assert tuple(float(b) for b in args.budgets.split(",")) == defaults.budgets
    assert (args.split, args.items, args.offset) == (defaults.split, defaults.items, defaults.offset)
    assert (args.batch_size, args.max_new_tokens, args.groups) == (
        defaults.batch_size, defaults.max_new_tokens, defaults.num_groups,
    )  # fmt: skip

"""End-to-end BFCL harness on a tiny random model: grammar-constrained, scored by bfcl-eval's checker."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import synthetic_stats

from pask_jax.calibration.compiler import compile_policy
from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.evaluate import EvalConfig, build_engines, format_table, run_bfcl
from pask_jax.models.decoder import Decoder
from pask_jax.models.tokenizer import qwen_tokenizer
from pask_jax.policy import ModelFingerprint, PersistencePolicy
from pask_jax.requests import RequestBuilder


@pytest.fixture(scope="module")
def tiny_qwen(tiny_qwen_vocab) -> Decoder:
    return tiny_qwen_vocab


def test_run_bfcl_shape_and_split(tiny_qwen: Decoder):
    cfg = EvalConfig(
        methods=("full", "streamingllm"), budgets=(0.5,), categories=("simple_python",), limit=2, max_new_tokens=24
    )
    result = run_bfcl(tiny_qwen, qwen_tokenizer(), "tiny", cfg)
    assert [(r["method"], r["budget"]) for r in result["runs"]] == [("full", 1.0), ("streamingllm", 0.5)]
    expected_ids = [item["id"] for item in bfcl.evaluation_sample("simple_python", 0, 2)]
    for run in result["runs"]:
        assert run["n"] == 2 and [i["id"] for i in run["items"]] == expected_ids
        assert not any(bfcl.is_calibration(i) for i in expected_ids)
        for item in run["items"]:
            # a random model rarely finishes a call in 24 tokens, but everything it wrote obeys the grammar (which
            # ends a call no sooner than its closing tag: the framing's three tokens always come first)
            assert item["text"].startswith("<tool_call>\n{")
            assert item["valid"] == (item["error_type"] is None)  # the checker's verdict, recorded as given
            assert item["parsed"] == (item["error_type"] != "ast_decoder:decoder_failed")
            assert item["kept_ratio_max"] <= (1.0 if run["method"] == "full" else 0.5 + 0.05)
    assert len(result["summary"]) == 2 and result["summary"][0]["overall"] is None  # one category: no 8-way mean
    assert "| full | 1 |" in format_table(result, ("simple_python",))


def test_an_interrupted_run_resumes_from_its_last_batch(tiny_qwen: Decoder, tmp_path, monkeypatch):
    from pask_jax.experiments.bfcl import evaluate

    cfg = EvalConfig(methods=("full",), categories=("simple_python",), limit=2, batch_size=1, max_new_tokens=6)
    saves, write_json = [], evaluate.write_json
    monkeypatch.setattr(
        evaluate, "write_json", lambda path, data: saves.append(json.dumps(data)) or write_json(path, data)
    )
    whole = run_bfcl(tiny_qwen, qwen_tokenizer(), "tiny", cfg, out=tmp_path / "whole.json")
    after_first, *_, last = map(json.loads, saves)  # saved after every batch, the category's runs at its end
    assert after_first["runs"] == [] and len(after_first["partial"]["items"]["full@1"]) == 1
    assert "partial" not in last and last["runs"] == whole["runs"]
    killed = tmp_path / "killed.json"  # as a run killed after its first batch left it
    killed.write_text(saves[0])
    batches, generate_shared = [], evaluate.generate_shared
    monkeypatch.setattr(evaluate, "generate_shared", lambda *a, **k: batches.append(a[1]) or generate_shared(*a, **k))
    resumed = run_bfcl(tiny_qwen, qwen_tokenizer(), "tiny", cfg, out=killed)
    assert len(batches) == 1  # only the missing batch ran
    assert [i["text"] for i in resumed["runs"][0]["items"]] == [i["text"] for i in whole["runs"][0]["items"]]
    with pytest.raises(ValueError, match="limit differ"):
        run_bfcl(tiny_qwen, qwen_tokenizer(), "tiny", dataclasses.replace(cfg, limit=1), out=killed)


def test_dev_split_scores_dev_items_and_refuses_policies_fitted_elsewhere(tiny_qwen: Decoder):
    cfg = EvalConfig(categories=("simple_python",), offset=2, limit=1, max_new_tokens=8, split="dev")
    result = run_bfcl(tiny_qwen, qwen_tokenizer(), "tiny", cfg)
    (item,) = result["runs"][0]["items"]
    assert item["id"] == bfcl.split_items("simple_python").dev[2]["id"] and bfcl.part_of(item["id"]) == "dev"

    fits = ModelFingerprint.of(tiny_qwen.config, qwen_tokenizer())

    def policy(items):
        layers = tiny_qwen.config.num_layers
        return PersistencePolicy("tiny", layers, groups=2, tables=(), calibration_items=items, fits=fits)

    evaluation_item = bfcl.evaluation_sample("multiple", 0, 1)[0]["id"]
    for calibrated in (evaluation_item, f"{evaluation_item}@2048:question_first"):  # an item's long prompt: the item
        with pytest.raises(ValueError, match=f"calibrated on {evaluation_item}, outside the calibration part"):
            run_bfcl(tiny_qwen, qwen_tokenizer(), "tiny", cfg, policies={"pask": policy((calibrated,))})
    old = EvalConfig(categories=("simple_python",), limit=1, max_new_tokens=8, split="dev", split_rule="item-hash")
    own = bfcl.dev_sample("simple_python", 0, 1, rule="item-hash")[0]["id"]
    with pytest.raises(ValueError, match="was calibrated on"):  # item-hash dev items are calibration items
        run_bfcl(tiny_qwen, qwen_tokenizer(), "tiny", old, policies={"pask": policy((f"{own}@1024:question_last",))})
    with pytest.raises(ValueError, match="split"):
        EvalConfig(split="test")
    with pytest.raises(ValueError, match="split_rule"):
        EvalConfig(split_rule="random")


def test_labelled_pask_variants_take_their_own_policy_else_the_pask_one(tiny_qwen: Decoder):
    layers = tiny_qwen.config.num_layers
    main = compile_policy(synthetic_stats(num_layers=layers, groups=2), [0.5])
    ablated = compile_policy(synthetic_stats(num_layers=layers, groups=2), [0.5], ablation="no_floors")
    cfg = EvalConfig(methods=("pask", "pask:s4", "pask:no_floors"), budgets=(0.5,))
    config = {"pask": {"sinks": 1}, "pask:s4": {"sinks": 4}}
    engines = build_engines(tiny_qwen, qwen_tokenizer(), cfg, config, {"pask": main, "no_floors": ablated})
    pask, s4, no_floors = (engines[(spec, 0.5)].method for spec in cfg.methods)
    assert pask.floor == s4.floor == tuple(map(tuple, main.table(0.5).floor.tolist()))
    assert (pask.sinks, s4.sinks) == (1, 4)
    assert no_floors.floor == tuple(map(tuple, ablated.table(0.5).floor.tolist())) != pask.floor


def test_long_context_items_list_distractors_and_the_grammar_allows_every_tool(tiny_qwen: Decoder):
    from pask_jax.experiments.bfcl.evaluate import _prepare

    item = bfcl.evaluation_sample("simple_python", 0, 1)[0]
    tok = qwen_tokenizer()
    builder = RequestBuilder(tok, None)
    short = _prepare(item, builder, EvalConfig(max_new_tokens=8))
    long = _prepare(item, builder, EvalConfig(max_new_tokens=8, context=700, layout="question_first"))
    assert len(short.ids) < 350 < len(long.ids) <= 700
    assert set(short.grammar.function_names) < set(long.grammar.function_names)  # every listed tool, not only its own
    assert all(f'"name": "{name}"' in long.text for name in long.grammar.function_names)
    cfg = EvalConfig(categories=("simple_python",), limit=1, max_new_tokens=4, context=700)
    (run,) = run_bfcl(tiny_qwen, tok, "tiny", cfg)["runs"]
    assert run["prepare_s"] > 0 and 350 < run["items"][0]["prompt_tokens"] <= 700
    with pytest.raises(ValueError, match="layout"):
        EvalConfig(context=700, layout="middle")


def test_prompt_framings_for_parallel_calls():
    from pathlib import Path

    from pask_jax.experiments.bfcl.evaluate import _prepare
    from pask_jax.experiments.bfcl.prompt import PARALLEL_INSTRUCTION
    from pask_jax.models.chat_template import ChatTemplate

    template = ChatTemplate(
        (Path(__file__).parents[1] / "data" / "qwen2.5_instruct.jinja").read_text(), eos_token="<|im_end|>"
    )
    builder = RequestBuilder(qwen_tokenizer(), template)
    item = bfcl.dev_sample("parallel", 0, 1)[0]
    with_system = dict(item, question=[[{"role": "system", "content": "Be brief."}, *item["question"][0]]])
    bfcl_prompt = _prepare(item, builder, EvalConfig(prompt="bfcl"))
    parallel = _prepare(item, builder, EvalConfig(prompt="bfcl_parallel"))
    own_system = _prepare(with_system, builder, EvalConfig(prompt="bfcl_parallel")).text
    assert PARALLEL_INSTRUCTION not in bfcl_prompt.text
    assert parallel.text.startswith(f"<|im_start|>system\n{PARALLEL_INSTRUCTION}\n\n# Tools")
    assert own_system.startswith(f"<|im_start|>system\n{PARALLEL_INSTRUCTION}\n\nBe brief.\n\n# Tools")
    assert parallel.grammar.function_names == bfcl_prompt.grammar.function_names
    own = _prepare(item, builder, EvalConfig(prompt="template"))
    assert own.text != bfcl_prompt.text and own.text.startswith("<|im_start|>system\nYou are Qwen")  # the template's
    assert own.request.tool_choice == "required" and own.grammar.parallel
    for bad in (
        {"prompt": "chat"},
        {"prompt": "template", "framing": "json_fence"},
        {"prompt": "template", "context": 700},
    ):
        with pytest.raises(ValueError, match="prompt"):
            EvalConfig(**bad)


def test_a_results_file_resumes_unless_a_section_its_methods_read_changed(tmp_path):
    """A results file records the method-config sections its methods read: a section added for another method
    changes nothing (an older file recording every section resumes too); a changed section they read is refused."""
    from pask_jax.experiments.bfcl.evaluate import read_results, run_config

    cfg = EvalConfig(methods=("kivi", "pask@int4"))
    sections = {"pask:v1": {"rank": "recency"}, "pask": {"sinks": 1}, "snapkv": {"window": 8}}
    config = run_config(cfg, sections, {})
    assert config["method_config"] == {"pask": {"sinks": 1}}  # the sections kivi and pask@int4 read
    path = tmp_path / "r.json"
    older = config | {"method_config": sections}  # a file that recorded every section
    path.write_text(json.dumps({"model": "m", "config": older, "runs": []}))
    more = sections | {"pask:release_first": {"release_first": True}}
    assert read_results(path, "m", run_config(cfg, more, {})) == ([], None)
    with pytest.raises(ValueError, match="method_config differ"):
        read_results(path, "m", run_config(cfg, sections | {"pask": {"sinks": 4}}, {}))

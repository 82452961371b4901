"""pask_jax.experiments.bfcl.merge: disjoint item ranges of one run join into the result of a single run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pask_jax.experiments.bfcl import merge as merge_bfcl


def item(i: int, valid: bool) -> dict:
    return {"id": f"simple_python_{i}", "valid": valid, "parsed": True, "kept_ratio_mean": 0.3, "kept_ratio_max": 0.33}


def result(items: list[dict], method: str = "snapkv") -> dict:
    run = {
        "method": method,
        "budget": 0.33,
        "category": "simple_python",
        "wall_s": 10.0,
        "n": len(items),
        "correct": sum(i["valid"] for i in items),
        "accuracy": 0.0,
        "decode_steps": 10 * len(items),
        "parser_seconds_per_step_fraction": 0.001,
        "items": items,
    }
    return {"model": "m", "config": {"offset": 0}, "runs": [run], "summary": []}


def test_merge_joins_items_and_recomputes_accuracy():
    merged = merge_bfcl.merge([result([item(0, True), item(1, False)]), result([item(2, True), item(3, True)])])
    (run,) = merged["runs"]
    assert run["n"] == 4 and run["correct"] == 3 and run["accuracy"] == 0.75 and run["wall_s"] == 20.0
    assert merged["summary"][0]["method"] == "snapkv"
    assert merge_bfcl.merge([result([item(0, True)])], methods={"full"})["runs"] == []


def test_merge_refuses_overlapping_items():
    with pytest.raises(ValueError, match="more than one result"):
        merge_bfcl.merge([result([item(0, True)]), result([item(0, False)])])
    interrupted = result([item(1, True)]) | {"partial": {"category": "multiple", "items": {}, "timing": {}}}
    with pytest.raises(ValueError, match="multiple under way"):
        merge_bfcl.merge([result([item(0, True)]), interrupted])


def test_merge_replace_takes_the_later_item():
    merged = merge_bfcl.merge([result([item(1, False)]), result([item(1, True)])], replace=True)
    (run,) = merged["runs"]
    assert run["n"] == 1 and run["correct"] == 1 and run["decode_steps"] == 10 and run["wall_s"] == 10.0
    with pytest.raises(ValueError, match="whole earlier results"):  # item 0 would lose its run's statistics
        merge_bfcl.merge([result([item(0, True), item(1, False)]), result([item(1, True)])], replace=True)
    merged = merge_bfcl.merge([result([item(0, True)]), result([item(1, False)]), result([item(1, True)])], None, True)
    assert [i["id"] for i in merged["runs"][0]["items"]] == ["simple_python_0", "simple_python_1"]
    assert merged["runs"][0]["correct"] == 2


def test_load_renames_methods(tmp_path: Path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result([item(0, True)], method="pask")))
    renamed = merge_bfcl.load(f"{path}#pask=pask:canonical8")
    assert [run["method"] for run in renamed["runs"]] == ["pask:canonical8"]
    merged = merge_bfcl.merge([renamed, merge_bfcl.load(str(path))])  # same items, now two methods
    assert sorted(run["method"] for run in merged["runs"]) == ["pask", "pask:canonical8"]
    with pytest.raises(ValueError, match="OLD=NEW"):
        merge_bfcl.load(f"{path}#snapkv=x")


def test_each_method_keeps_the_settings_of_the_result_that_ran_it():
    a, b = result([item(0, True)], method="snapkv:w8"), result([item(1, True)], method="pask")
    a["config"]["method_config"] = {"snapkv": {"window": 32}, "snapkv:w8": {"window": 8}, "pask": {"rank": "recency"}}
    b["config"]["method_config"] = {"snapkv": {"window": 16}, "pask": {"rank": "dapq_tier"}}
    merged = merge_bfcl.merge([a, b])["config"]["method_config"]
    assert merged == {"snapkv": {"window": 32}, "snapkv:w8": {"window": 8}, "pask": {"rank": "dapq_tier"}}

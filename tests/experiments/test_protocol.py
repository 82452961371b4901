"""The tuning rule: most correct dev items, ties to the default, then to the grid's order."""

from __future__ import annotations

import pytest

from pask_jax.experiments.bfcl.protocol import choose_variants, dev_totals


def _run(spec: str, budget: float, right: list[bool], category: str = "simple_python") -> dict:
    items = [{"id": f"{category}_{k}", "valid": v} for k, v in enumerate(right)]
    return {"method": spec, "budget": budget, "category": category, "items": items}


def _result(runs: list[dict], split: str = "dev") -> dict:
    return {"config": {"split": split}, "runs": runs}


def test_most_correct_wins_and_ties_go_to_the_default_then_the_first_listed():
    runs = [
        _run("full", 1.0, [True, True, True]),
        _run("snapkv:w8", 0.33, [True, True, False]),
        _run("snapkv", 0.33, [True, True, False]),  # ties w8: the default wins though listed later
        _run("dapq:n8", 0.33, [True, False, False]),
        _run("dapq:n16", 0.33, [True, False, False]),  # ties n8, no default among them: the first listed
        _run("dapq", 0.33, [False, False, False]),
        _run("h2o", 0.33, [False, False, False]),
        _run("h2o:r25", 0.33, [True, False, False]),  # more correct beats the default
        _run("h2o:r25", 0.2, [True, True, True]),  # another budget does not count
    ]
    assert choose_variants(_result(runs), 0.33) == {"snapkv": "snapkv", "dapq": "dapq:n8", "h2o": "h2o:r25"}
    assert dev_totals(_result(runs), 0.33)["h2o:r25"] == (1, 3)


def test_only_dev_results_and_equal_item_counts():
    with pytest.raises(ValueError, match="dev result"):
        choose_variants(_result([_run("snapkv", 0.33, [True])], split="evaluation"), 0.33)
    uneven = [_run("snapkv", 0.33, [True]), _run("snapkv:w8", 0.33, [True, False])]
    with pytest.raises(ValueError, match="different numbers"):
        choose_variants(_result(uneven), 0.33)

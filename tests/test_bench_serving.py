"""The serving benchmark (scripts/bench_serving.py) end to end on the random tiny model, plus its pieces by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax import cli

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"
ARGS = [
    "--model", "tiny",
    "--methods", "full,pask,snapkv",
    "--budgets", "0.33",
    "--workloads", "bfcl",
    "--memory-batch", "2",
    "--max-batch", "8",
    "--max-new-tokens", "8",
    "--pool", "4",
    "--repeats", "3",
    "--sweep-budgets", "1.0,0.2",
]  # fmt: skip
PROMPT_BUCKET, NEW_BUCKET = 256, 64  # synthetic "bfcl" prompts are 64..255 tokens; 8 new tokens -> one 64 bucket


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    module = sys.modules["bench_serving"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_bench()


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("serving") / "serving.json"
    returned = bench.main([*ARGS, "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["runs"] == json.loads(json.dumps(returned["runs"]))
    assert out.with_suffix(".png").stat().st_size > 0 and "| bfcl | pask |" in out.with_suffix(".md").read_text()
    return written


def runs_by_method(result: dict) -> dict[str, dict]:
    return {r["method"]: r for r in result["runs"]}


def hand_cache_bytes(fraction: float, batch: int) -> int:
    """Tiny model (2 layers -> 2 groups of 1 layer, K=2 KV heads, H=16, float32): K and V f32[C, H] per slot, then
    pos / role / score / table (4 bytes each) per slot, a length per (row, head) and one overflow flag per group."""
    capacity = min(math.ceil(round(fraction * (PROMPT_BUCKET + NEW_BUCKET), 6)), PROMPT_BUCKET + NEW_BUCKET) + 1
    kv_heads, head_dim = 2, 16
    per_group = batch * kv_heads * capacity * (2 * head_dim * 4 + 4 * 4) + batch * kv_heads * 4 + 1
    return 2 * per_group


def test_json_has_the_required_shape(result):
    assert result["complete"] and result["model"] == "tiny"
    assert {(r["method"], r["budget"]) for r in result["runs"]} == {("full", 1.0), ("pask", 0.33), ("snapkv", 0.33)}
    for run in result["runs"]:
        for key in ("method", "budget", "workload", "batch", "tokens_per_s", "tpot_ms", "ttft_ms", "peak_memory_bytes"):
            assert key in run, key
        assert {"throughput", "tpot", "peak_memory"} <= set(run["ratio_vs_full"])
        assert run["workload"] == "bfcl" and run["tokens_per_s"] > 0 and run["tpot_ms"] > 0 and run["ttft_ms"] > 0
        assert run["tpot_p95_ms"] >= run["tpot_ms"] * 0.5 and run["peak_memory_bytes"] > 0
        assert set(run["memory"]["xla"]) == {"prefill", "decode"}, run["memory"]["xla"]  # analysis ran on CPU
        assert run["memory"]["peak_source"] == "xla_memory_analysis"
    assert result["workloads"]["bfcl"]["prompt_bucket"] == PROMPT_BUCKET


def test_full_kv_ratios_are_one(result):
    full = runs_by_method(result)["full"]
    assert full["ratio_vs_full"] and all(v == pytest.approx(1.0) for v in full["ratio_vs_full"].values())
    assert runs_by_method(result)["pask"]["ratio_vs_full"]["cache_bytes_per_sequence"] == pytest.approx(
        hand_cache_bytes(0.33, 1) / hand_cache_bytes(1.0, 1), rel=1e-3
    )


def test_cache_bytes_match_a_hand_count():
    setup = bench.load_setup(bench.BenchConfig(model="tiny"))
    for method, budget in (("full", 1.0), ("snapkv", 0.33), ("pask", 0.2)):
        engine = bench.make_engine(setup, method, budget, bench.BenchConfig(model="tiny"))
        for batch in (1, 2, 8):
            assert bench.cache_bytes(engine, PROMPT_BUCKET, 8, batch) == hand_cache_bytes(budget, batch)


def test_largest_batch_is_the_largest_fitting_power_of_two():
    assert bench.largest_batch(lambda b: 100 * b + 1, 750) == 4  # 8 rows would take 801 bytes
    assert bench.unpadded_fit(lambda b: 100 * b + 1, 750) == 7
    assert bench.largest_batch(lambda b: 100 * b + 1, 801) == 8
    assert bench.largest_batch(lambda b: 100 * b + 1, 50) == 0
    assert bench.largest_batch(lambda b: 100 * b + 1, 10**9, ceiling=16) == 16
    assert [bench.padded_batch(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]  # what the engine allocates


def test_batches_under_full_kvs_memory_match_the_hand_count(result):
    limit = hand_cache_bytes(1.0, 2)  # Full KV at --memory-batch 2
    runs = runs_by_method(result)
    assert all(r["memory"]["limit_bytes"] == limit for r in result["runs"])
    expected = max(b for b in (1, 2, 4, 8, 16) if hand_cache_bytes(0.33, b) <= limit)
    assert expected == 4 and hand_cache_bytes(0.33, 8) > limit
    assert (runs["full"]["fit_batch"], runs["full"]["batch"]) == (2, 2)
    for method in ("pask", "snapkv"):
        run = runs[method]
        assert (run["fit_batch"], run["batch"], run["batch_capped"]) == (expected, expected, False)
        per_row = hand_cache_bytes(0.33, 2) - hand_cache_bytes(0.33, 1)
        assert run["fit_batch_unpadded"] == (limit - (hand_cache_bytes(0.33, 1) - per_row)) // per_row == 5
        assert run["batch"] > runs["full"]["batch"] and run["memory"]["cache_bytes"] <= limit
        assert run["kept_ratio_max"] <= 0.33 + 0.01  # the running cap, plus the one-entry slack


def test_no_recompiles_after_warmup(result):
    for run in result["runs"]:
        assert run["recompiles_after_warmup"] == 0 and all(r["recompiles"] == 0 for r in run["repeats"])
    assert all(p["recompiles_after_warmup"] == 0 for p in result["decode_sweep"]["points"])


def test_the_compile_counter_counts():
    before = bench.compiles_so_far()
    jax.jit(lambda x: jnp.cos(x) * 3.25)(jnp.ones(7)).block_until_ready()
    assert bench.compiles_so_far() > before


def test_repeats_give_median_and_spread(result):
    full = runs_by_method(result)["full"]
    for run in result["runs"]:
        assert len(run["repeats"]) == 3
        values = [r["tokens_per_s"] for r in run["repeats"]]
        stats = run["spread"]["tokens_per_s"]
        assert stats["median"] == pytest.approx(np.median(values)) == pytest.approx(run["tokens_per_s"])
        assert stats["min"] == min(values) and stats["max"] == max(values) and stats["q1"] <= stats["q3"]
        ratios = [r["tokens_per_s"] / f["tokens_per_s"] for r, f in zip(run["repeats"], full["repeats"], strict=True)]
        assert run["ratio_vs_full"]["throughput"] == pytest.approx(np.median(ratios))
        assert run["ratio_spread"]["throughput"]["min"] == pytest.approx(min(ratios))


def test_decode_sweep_records_kept_slots_per_layer(result):
    sweep = result["decode_sweep"]
    points = {p["budget"]: p for p in sweep["points"]}
    assert set(points) == {1.0, 0.2} and sweep["batch"] == 1
    assert points[1.0]["capacity_slots_per_layer"] == [PROMPT_BUCKET + NEW_BUCKET + 1] * 2
    assert points[0.2]["capacity_slots_per_layer"] == [65, 65]
    assert points[0.2]["kept_ratio_max"] <= 0.21 and points[1.0]["kept_ratio_mean"] == pytest.approx(1.0)
    assert points[0.2]["tpot_ms"]["median"] > 0 and points[1.0]["tpot_ratio_vs_top_budget"] == 1.0


def test_workload_names_and_warmup_length():
    assert [bench.workload_tokens(n) for n in ("bfcl", "2k", "8k", "512")] == [None, 2048, 8192, 512]
    with pytest.raises(ValueError, match="workload"):
        bench.workload_tokens("long")
    # the warm-up keeps the timed calls' decode-capacity bucket and runs at least one decode step
    assert [bench.warmup_tokens(n) for n in (1, 2, 16, 64, 65, 100)] == [1, 2, 2, 2, 65, 65]
    for n in (16, 64, 65, 100, 200):
        assert bench.new_token_bucket(bench.warmup_tokens(n)) == bench.new_token_bucket(n)


def test_long_context_prompt_fills_the_tools_list_up_to_the_target():
    from pask_jax import bfcl, load_tokenizer
    from pask_jax.models.chat_template import bfcl_prompt
    from pask_jax.structure.prompt_roles import prompt_roles

    tokenizer = load_tokenizer("qwen")
    item = bfcl.evaluation_sample("simple_python", 0, 1)[0]
    text, tools = bench.long_context_prompt(item, tokenizer, 2048, seed=0)
    n = len(tokenizer.encode(text))
    assert 0.9 * 2048 <= n <= 2048, n
    names = [t["name"] for t in tools]
    assert item["function"][0]["name"] in names and len(names) == len(set(names)) > 5
    assert len(prompt_roles(text, tokenizer, tools)) == n
    assert n > 3 * len(tokenizer.encode(bfcl_prompt(item)))


def test_cli_forwards_to_the_script(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0 and "--memory-batch" in capsys.readouterr().out

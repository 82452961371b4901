"""The benchmarks (`experiments.bench`) on tiny random models: serving end to end, decode vs transformers, cache
bytes, compile times."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pask_jax.experiments.bench
from pask_jax.experiments.bench import decode, machine, serving, workloads
from pask_jax.memory import rows_fitting
from pask_jax.runtime.shapes import new_token_bucket, padded_batch
from pask_jax.structure.roles import Role

REPO = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("serving") / "serving.json"
    returned = pask_jax.experiments.bench.main(["serving", *ARGS, "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["runs"] == json.loads(json.dumps(returned["runs"]))
    assert out.with_suffix(".png").stat().st_size > 0 and "| bfcl | pask |" in out.with_suffix(".md").read_text()
    return written


@pytest.fixture(scope="module")
def tiny_setup() -> serving.Setup:
    return serving.load_setup(serving.BenchConfig(model="tiny"))


def runs_by_method(result: dict) -> dict[str, dict]:
    return {r["method"]: r for r in result["runs"]}


def hand_cache_bytes(fraction: float, batch: int) -> int:
    """Tiny model (2 layers -> 2 groups of 1 layer, K=2 KV heads, H=16, float32): K and V f32[C, H] per slot, then
    pos i16 / role i8 / tool i16 / score f32 / table i32 (13 bytes) per slot, a length per (row, head), one overflow
    flag per group. Below b = 1 the slots are the entries the budget's bytes pay for: a bf16 entry of 64 bytes (the
    reference) costs 64 + 13 with its metadata."""
    full = PROMPT_BUCKET + NEW_BUCKET
    entries = fraction * full * (64 / 77 if fraction < 1 else 1)
    capacity = min(math.ceil(round(entries, 6)), full) + 1
    kv_heads, head_dim = 2, 16
    per_group = batch * kv_heads * capacity * (2 * head_dim * 4 + 13) + batch * kv_heads * 4 + 1
    return 2 * per_group


# ---- serving -------------------------------------------------------------------------------------------------------


def test_json_has_the_required_shape(result):
    assert result["complete"] and result["model"] == "tiny"
    assert result["command"].startswith("pask-jax bench serving --model tiny")
    assert {"cpu", "cpu_count", "jax", "jax_backend", "devices"} <= set(result["machine"])
    assert {(r["method"], r["budget"]) for r in result["runs"]} == {("full", 1.0), ("pask", 0.33), ("snapkv", 0.33)}
    for run in result["runs"]:
        for key in ("method", "budget", "workload", "batch", "tokens_per_s", "tpot_ms", "ttft_ms", "peak_memory_bytes"):
            assert key in run, key
        assert {"throughput", "tpot", "peak_memory"} <= set(run["ratio_vs_full"])
        assert run["workload"] == "bfcl" and run["tokens_per_s"] > 0 and run["tpot_ms"] > 0 and run["ttft_ms"] > 0
        assert run["tpot_p95_ms"] >= run["tpot_ms"] * 0.5 and run["peak_memory_bytes"] > 0
        assert set(run["memory"]["xla"]) == {"prefill", "decode"}, run["memory"]["xla"]  # analysis ran on CPU
        assert run["memory"]["peak_source"] == "xla_memory_analysis"
        xla = run["memory"]["xla"]["decode"]
        assert xla["peak"] == sum(xla[f] for f in serving.MEMORY_FIELDS) - 2 * xla["alias_size_in_bytes"]
    assert result["workloads"]["bfcl"]["prompt_bucket"] == PROMPT_BUCKET


def test_full_kv_ratios_are_one(result):
    full = runs_by_method(result)["full"]
    assert full["ratio_vs_full"] and all(v == pytest.approx(1.0) for v in full["ratio_vs_full"].values())
    assert runs_by_method(result)["pask"]["ratio_vs_full"]["cache_bytes_per_sequence"] == pytest.approx(
        hand_cache_bytes(0.33, 1) / hand_cache_bytes(1.0, 1), rel=1e-3
    )


def test_cache_bytes_match_a_hand_count(tiny_setup):
    for method, budget in (("full", 1.0), ("snapkv", 0.33), ("pask", 0.2)):
        engine = serving.bench_engine(tiny_setup, method, budget, serving.BenchConfig(model="tiny"))
        for batch in (1, 2, 8):
            shape = serving.rows_shape(engine, PROMPT_BUCKET, 8, batch)
            assert engine.cache_bytes(shape) == hand_cache_bytes(budget, batch)


def test_largest_batch_is_the_largest_fitting_power_of_two():
    assert serving.largest_batch(lambda b: 100 * b + 1, 750) == 4  # 8 rows would take 801 bytes
    assert rows_fitting(lambda b: 100 * b + 1, 750) == 7
    assert serving.largest_batch(lambda b: 100 * b + 1, 801) == 8
    assert serving.largest_batch(lambda b: 100 * b + 1, 50) == 0
    assert serving.largest_batch(lambda b: 100 * b + 1, 10**9, ceiling=16) == 16
    assert [padded_batch(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]  # what the engine allocates


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
        assert run["fit_batch_unpadded"] == (limit - (hand_cache_bytes(0.33, 1) - per_row)) // per_row == 7
        assert run["batch"] > runs["full"]["batch"] and run["memory"]["cache_bytes"] <= limit
        assert run["memory"]["cache_bytes"] == hand_cache_bytes(0.33, expected)
        assert run["kept_ratio_max"] <= 0.33 + 0.01  # the running cap, plus the one-entry slack


def test_no_recompiles_after_warmup(result):
    for run in result["runs"]:
        assert run["recompiles_after_warmup"] == 0 and all(r["recompiles"] == 0 for r in run["repeats"])
    assert all(p["recompiles_after_warmup"] == 0 for p in result["decode_sweep"]["points"])


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
    assert points[0.2]["capacity_slots_per_layer"] == [55, 55]  # ceil(0.2 * 320 * 64 / 77) + 1
    assert points[0.2]["kept_ratio_max"] <= 0.21 and points[1.0]["kept_ratio_mean"] == pytest.approx(1.0)
    assert points[0.2]["tpot_ms"]["median"] > 0 and points[1.0]["tpot_ratio_vs_top_budget"] == 1.0


def test_warmup_keeps_the_capacity_bucket():
    # the warm-up keeps the timed calls' decode-capacity bucket and runs at least one decode step
    assert [serving.warmup_tokens(n) for n in (1, 2, 16, 64, 65, 100)] == [1, 2, 2, 2, 65, 65]
    for n in (16, 64, 65, 100, 200):
        assert new_token_bucket(serving.warmup_tokens(n)) == new_token_bucket(n)


def test_serving_refuses_bad_flags_before_loading(capsys):
    for bad in (["--workloads", "long"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            serving.main(["--model", "tiny", *bad])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "workload 'long'" in err and "--repeats" in err


def test_request_stream_static_and_continuous_under_one_memory_limit(tmp_path):
    """`--scheduler`: both schedulers serve every request; rows follow the memory limit (static: a power of two,
    continuous: any count that fits, so at least as many), no compile after the warm-up, ratios per repeat."""
    out = tmp_path / "stream.json"
    args = ["--model", "tiny", "--scheduler", "static,continuous", "--workloads", "bfcl", "--pool", "5"]
    args += ["--methods", "full,snapkv,pask", "--budgets", "0.33", "--max-new-tokens", "6", "--memory-batch", "2"]
    result = pask_jax.experiments.bench.main(
        ["serving", *args, "--repeats", "2", "--prefill-rows", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text())["complete"] and "| bfcl | snapkv | 0.33 | continuous |" in (
        out.with_suffix(".md").read_text()
    )
    part = result["workloads"]["bfcl"]
    runs = {(r["method"], r["scheduler"]): r for r in part["runs"]}
    assert set(runs) == {(m, s) for m in ("full", "snapkv", "pask") for s in ("static", "continuous")}
    assert runs["full", "static"]["rows"] == runs["full", "continuous"]["rows"] == 2
    assert runs["snapkv", "continuous"]["rows"] >= runs["snapkv", "static"]["rows"] > 2
    assert runs["snapkv", "static"]["rows"] & (runs["snapkv", "static"]["rows"] - 1) == 0  # a power of two
    for r in part["runs"]:
        assert r["cache_bytes"] <= part["memory_limit_bytes"] and r["recompiles_after_warmup"] == 0
        assert [x["requests"] for x in r["repeats"]] == [5, 5] and r["output_tokens_per_s"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p95_ms"] <= r["latency_p95_ms"]
    assert runs["full", "continuous"]["ratio_vs_full"]["requests_per_s"] == 1.0
    with pytest.raises(SystemExit):
        serving.main(["--model", "tiny", "--scheduler", "paged"])


def test_request_stream_with_the_grammar_on_and_off_the_critical_path(tmp_path):
    """continuous against continuous-sync: the same rows and output tokens; the continuous run carries its
    per-repeat ratios against the sync run of the same engine, the sync run none."""
    args = ["--model", "tiny", "--scheduler", "continuous,continuous-sync", "--workloads", "bfcl", "--pool", "3"]
    args += ["--methods", "full", "--max-new-tokens", "6", "--memory-batch", "2", "--repeats", "1"]
    result = pask_jax.experiments.bench.main(["serving", *args, "--out", str(tmp_path / "overlap.json")])
    runs = {r["scheduler"]: r for r in result["workloads"]["bfcl"]["runs"]}
    overlap, sync = runs["continuous"], runs["continuous-sync"]
    assert overlap["rows"] == sync["rows"] and sync["vs_sync"] is None
    assert overlap["repeats"][0]["output_tokens"] == sync["repeats"][0]["output_tokens"] > 0
    expected = overlap["repeats"][0]["requests_per_s"] / sync["repeats"][0]["requests_per_s"]
    assert overlap["vs_sync"]["requests_per_s"] == pytest.approx(expected) and overlap["vs_sync"]["tpot_ms"] > 0


# ---- workloads, machine --------------------------------------------------------------------------------------------


def test_workload_names_and_synthetic_prompts():
    assert [workloads.workload_tokens(n) for n in ("bfcl", "2k", "8k", "512")] == [None, 2048, 8192, 512]
    with pytest.raises(ValueError, match="workload"):
        workloads.workload_tokens("long")
    w = workloads.build_workload("1k", None, 256, pool=3, seed=0)
    lengths = [len(p) for p in w.prompts]
    assert lengths == sorted(lengths, reverse=True) and all(0.9 * 1024 <= n <= 1024 for n in lengths)
    assert w.prompt_bucket == 1024 and w.grammars is None
    for p, r in zip(w.prompts, w.roles, strict=True):
        assert r[0] == Role.SINK and set(r[1:]) == {Role.REQUEST_TEXT} and len(r) == len(p)
    prompts, roles, grammars = w.take(5)  # a batch cycles through the pool
    assert prompts == [*w.prompts, *w.prompts[:2]] and roles == [*w.roles, *w.roles[:2]] and grammars is None


def test_machine_and_code_state():
    info = machine.machine_info()
    assert info["cpu_count"] >= info["cpu_affinity"] >= 1 and info["jax"] == jax.__version__
    assert info["jax_backend"] == jax.default_backend() and info["cpu"]
    assert (info["device_memory"] is None) == (jax.default_backend() == "cpu")
    code = machine.code_state()
    assert len(code["runtime_sha256"]) == 16
    assert code["commit"] == "" or len(code["commit"]) == 40  # "" outside a git checkout


def test_the_compile_counter_counts():
    before = machine.compiles_so_far()
    jax.jit(lambda x: jnp.cos(x) * 3.25)(jnp.ones(7)).block_until_ready()
    assert machine.compiles_so_far() > before


# ---- cache bytes ---------------------------------------------------------------------------------------------------


def test_cache_bench_reproduces_the_committed_numbers(tmp_path):
    committed = json.loads((REPO / "results" / "cache_bytes.json").read_text())
    args = committed["args"]
    out = tmp_path / "cache.json"
    result = pask_jax.experiments.bench.main(
        ["cache", "--model", args["model"], "--prompt-len", args["prompt_len"], "--new-tokens", args["new_tokens"]]
        + ["--batch", args["batch"], "--out", str(out)]
    )
    assert result["rows"] == committed["rows"] == json.loads(out.read_text())["rows"]


# ---- decode vs transformers ----------------------------------------------------------------------------------------


def tiny_pair(tmp_path: Path):
    """A tiny random transformers Qwen2 and our model loaded from its checkpoint: the same weights on both sides."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pask_jax.models.loading import load_hf_checkpoint

    config = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.2)
            if "norm" in name:
                p.add_(1.0)
    hf.save_pretrained(tmp_path)
    decode.greedy_without_stop(hf, pad_id=0)
    return load_hf_checkpoint(tmp_path), hf


def test_decode_bench_end_to_end_on_a_tiny_pair(tmp_path):
    model, hf = tiny_pair(tmp_path)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 128, n)] for n in (9, 14, 5)]
    cfg = decode.DecodeConfig(
        model="tiny", batches=(1, 3), new_tokens=4, warmup_tokens=2, repeats=1, quick=True, bandwidth_mib=4
    )
    result = decode.run_benchmark(cfg, model, hf, prompts, decode_text=lambda ids: " ".join(map(str, ids)))
    assert [e["batch"] for e in result["results"]] == [1, 3] and result["sanity_batch1_first_prompt_identical"]
    assert {"torch", "transformers", "loadavg_end", "cpu"} <= set(result["machine"])
    weights = result["roofline"]["weights"]
    assert weights["lm_head_tied"] and weights["bytes"] == 4 * sum(p.numel() for p in hf.parameters())  # tied: once
    assert result["roofline"]["bandwidth"]["gb_s"] > 0 and result["roofline"]["kv_dtype_bytes"] == 4
    for entry in result["results"]:
        ours = entry["ours"]
        lengths = [len(p) for p in prompts[: entry["batch"]]]
        assert entry["prompt_lengths"]["max"] == max(lengths) and entry["prompt_lengths"]["min"] == min(lengths)
        roof = entry["roofline"]
        assert roof["kv_tokens_mean_step"] == sum(lengths) + 2 * entry["batch"]  # + new_tokens / 2 per sequence
        assert roof["bytes"] == weights["bytes"] + 2 * 2 * 16 * 2 * 4 * roof["kv_tokens_mean_step"]  # L K H (K,V) f32
        assert roof["fraction"]["ours"] == pytest.approx(roof["roofline_step_ms"] / ours["tpot_ms"], rel=1e-2)
        assert ("transformers_1_thread" in roof["fraction"]) == (entry["batch"] == 1)
        assert entry["same_greedy_tokens"]["rows_identical"] == entry["batch"]  # same weights, greedy
        assert ours["decode_steps"] == entry["transformers"]["decode_steps"] == 3
        assert ours["backend_compiles"]["timed"] == 0 and ours["backend_compiles"]["warmup"] >= 0
        assert ours["step_probe_ms_median"]["decode_call"] <= ours["step_ms_median"] + 1e-6
        assert ours["padding"]["length_bucket"] == 64 and ours["padding"]["batch_bucket"] == padded_batch(
            entry["batch"]
        )
        assert entry["ours_over_transformers"]["decode_speedup"] > 0
    assert "transformers_1_thread" in result["results"][0] and "transformers_1_thread" not in result["results"][1]
    pieces = {p["batch"]: p for p in result["decode_step_pieces"]}
    assert set(pieces) == {1, 3} and pieces[3]["our_padded_batch"] == 4
    assert all(ms > 0 for ms in pieces[3]["ms_median"].values()) and "ours/decode_step_real" in pieces[3]["ms_min"]
    assert set(result["decode_step_hlo"]) == {"1", "3"}
    assert {"weight_relayout", "other_big_copies"} <= set(result["decode_step_hlo"]["3"])
    assert len(decode.summary_table(result).splitlines()) == 2 + len(cfg.batches)


def test_run_ours_reports_every_decode_call(tiny_setup):
    engine = serving.bench_engine(tiny_setup, "full", 1.0, serving.BenchConfig(model="tiny"))
    run = decode.run_ours(engine, [[3, 4, 5], [6, 7]], 5)
    assert len(run["step_s"]) == len(run["probe_ms"]["decode_call"]) == 4
    assert all(0 < call <= 1e3 * step for call, step in zip(run["probe_ms"]["decode_call"], run["step_s"], strict=True))


def test_hlo_copies_reads_weight_relayouts():
    text = "\n".join(
        [
            "  %transpose.1 = f32[64,14,896]{2,1,0} transpose(%p), metadata={op_name=\"jit(decode)/params['o']\"}",
            '  %copy.2 = f32[400,400]{1,0} copy(%x), metadata={op_name="jit(decode)/caches"}',
            "  %copy.3 = f32[4]{0} copy(%y), metadata={op_name=\"jit(decode)/params['b']\"}",  # too small
        ]
    )
    out = decode.hlo_copies(text)
    assert out["weight_relayout"] == {"transpose": {"count": 1, "mb": round(64 * 14 * 896 * 4 / 2**20, 2)}}
    assert out["other_big_copies"] == {"copy": {"count": 1, "mb": round(400 * 400 * 4 / 2**20, 2)}}


# ---- the command line ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("benchmark, flag", [("serving", "--memory-batch"), ("decode", "--warmup-tokens")])
def test_subcommand_help_exits_zero(capsys, benchmark, flag):
    with pytest.raises(SystemExit) as exit_info:
        pask_jax.experiments.bench.main([benchmark, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and f"pask-jax bench {benchmark}" in out and flag in out


def test_bench_usage_and_unknown_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pask_jax.experiments.bench.main(["--help"])
    usage = capsys.readouterr().out
    assert exit_info.value.code == 0 and all(f"\n  {name} " in usage for name in pask_jax.experiments.bench.BENCHMARKS)
    for argv in ([], ["servng"]):
        with pytest.raises(SystemExit) as exit_info:
            pask_jax.experiments.bench.main(argv)
        assert exit_info.value.code == 2 and "pask-jax bench {serving" in capsys.readouterr().err


def test_entrypoints_bench_runs_both_paths_on_the_same_items(tiny_qwen_vocab, qwen_tok, capsys):
    from pask_jax.experiments.bench.entrypoints import compare_entrypoints
    from pask_jax.experiments.bfcl.evaluate import EvalConfig
    from pask_jax.llm import LLM
    from pask_jax.models.chat_template import ChatTemplate

    template = ChatTemplate((Path(__file__).parents[1] / "data" / "qwen2.5_instruct.jinja").read_text(), "<|im_end|>")
    llm = LLM(tiny_qwen_vocab, method="full", tokenizer=qwen_tok, chat_template=template, policy=None, max_batch=4)
    cfg = EvalConfig(categories=("simple_python",), limit=2, split="dev", max_new_tokens=6, batch_size=4)
    result = compare_entrypoints(llm, cfg, repeats=1)
    ids = [item["id"] for item in cfg.sample("simple_python")]
    assert result["item_ids"] == ids and result["items"] == 2 and len(result["timed"]) == 1
    for side in ("run", "bfcl"):
        assert sorted(result["calls"][side]) == sorted(ids)  # every item answered on both paths
        timed = result["timed"][0][side]
        assert 0 < timed["tokens"] <= 2 * 6 and timed["wall_s"] > 0 and timed["failed"] == 0
        assert result[f"{side}_tokens_per_s"] == timed["tokens"] / timed["wall_s"]
    assert result["run_over_bfcl"] == result["run_tokens_per_s"] / result["bfcl_tokens_per_s"]
    assert "round 1:" in capsys.readouterr().out


def test_prep_bench_times_every_stage_cold_and_warm_per_backend(tiny_qwen_vocab, qwen_tok, capsys):
    """Both backends on two BFCL bodies and two user requests (one free text): every stage is timed, the cold
    outlines compile outweighs the warm one (the in-memory cache), the batch's host and device seconds add up."""
    from pask_jax.experiments.bench.prep import STAGES, bfcl_bodies, measure, user_bodies
    from pask_jax.llm import LLM
    from pask_jax.models.chat_template import ChatTemplate

    template = ChatTemplate((Path(__file__).parents[1] / "data" / "qwen2.5_instruct.jinja").read_text(), "<|im_end|>")
    requests = Path(__file__).parents[2] / "examples" / "requests.jsonl"
    user = [b for b in user_bodies(requests, 5) if not b.get("tools")][:1] + user_bodies(requests, 5)[:1]
    mixes = {"bfcl": bfcl_bodies(1, 5), "user": user}

    def make_llm(backend: str) -> LLM:
        return LLM(tiny_qwen_vocab, method="full", tokenizer=qwen_tok, chat_template=template, grammar_backend=backend)

    results, vocabulary_s = measure(make_llm, ("outlines", "llguidance"), mixes, speedup=100.0)
    assert vocabulary_s > 0 and sorted(results) == ["llguidance", "outlines"]
    for summary in (s for per_mix in results.values() for s in per_mix.values()):
        assert summary["requests"] == 2 and summary["tokens"] > 0
        for row in summary["per_request"]["cold"]:
            assert set(STAGES) <= set(row) and row["total_s"] == sum(row[stage] for stage in STAGES)
        assert summary["device_s_per_request"] > 0 and summary["mask_s_per_request"] >= 0
        assert summary["host_over_device_at_speedup"] == pytest.approx(100 * summary["host_over_device"], rel=0.05)
    outlines = results["outlines"]["bfcl"]
    assert outlines["cold"]["grammar_s"] > 10 * outlines["warm"]["grammar_s"]  # compiled, then from memory
    assert "outlines   bfcl" in capsys.readouterr().out


def test_compile_bench_times_each_step_and_warm_compiles_load_from_the_cache(tmp_path):
    """In its own process (the persistent XLA cache is process-wide state): every step is timed, and the warm pass
    takes both executables of every (method, length) from the fresh cache the cold pass filled; XLA's memory analysis
    of each executable is recorded."""
    import subprocess
    import sys

    out = tmp_path / "compile.json"
    args = ["--model", "tiny", "--methods", "full,h2o", "--prompt-tokens", "64,128", "--out", str(out)]
    subprocess.run(
        [sys.executable, "-m", "pask_jax.experiments.bench", "compile", *args], check=True, capture_output=True
    )
    result = json.loads(out.read_text())
    assert [(r["method"], r["prompt_tokens"]) for r in result["steps"]] == [
        ("full", 64), ("h2o", 64), ("full", 128), ("h2o", 128)
    ]  # fmt: skip
    for row in result["steps"]:
        assert row["cold"]["cache_hits"] == 0 and row["warm"]["cache_hits"] == 2, row
        assert row["cold"]["shape"]["prompt_bucket"] == row["prompt_tokens"]
        for step in ("prefill", "decode"):
            assert row["cold"][step]["compile_s"] > 0 and row["warm"][step]["lower_s"] >= 0
            assert row["cold"][step]["argument_mib"] > 0 and row["cold"][step]["temp_mib"] >= 0
    full, h2o = (r["cold"]["prefill"] for r in result["steps"][2:])
    assert full["output_mib"] > h2o["output_mib"]  # full KV's prefill hands over the whole cache
    assert "first_answer" not in result  # the tiny model has no tokenizer


def test_compile_bench_times_a_sweep_as_shared_prefills_and_a_decode_per_method(tmp_path):
    """--shared: one prefill executable per group of methods (labelled variants from --method-config among them), a
    decode step per method; the warm pass loads every one of them from the cache."""
    import subprocess
    import sys

    config = tmp_path / "variants.toml"
    config.write_text('["h2o:r25"]\nrecent_fraction = 0.25\n')
    out = tmp_path / "sweep.json"
    methods = "full,h2o,h2o:r25,snapkv"
    args = ["--model", "tiny", "--methods", methods, "--prompt-tokens", "64", "--shared", "--out", str(out)]
    compile_bench = [sys.executable, "-m", "pask_jax.experiments.bench", "compile"]
    grouped = [*args, "--method-config", str(config), "--plans-per-prefill", "3"]
    subprocess.run([*compile_bench, *grouped], check=True, capture_output=True)
    (row,) = json.loads(out.read_text())["steps"]
    assert row["methods"] == methods.split(",") and row["prompt_tokens"] == 64
    cold, warm = row["cold"], row["warm"]
    assert [g["plans"] for g in cold["prefill_groups"]] == [2, 2]  # 4 methods, at most 3 a prefill: two of 2
    assert cold["prefill"]["compile_s"] == pytest.approx(sum(g["compile_s"] for g in cold["prefill_groups"]), abs=2e-3)
    assert list(cold["decode"]) == methods.split(",") and cold["prefill"]["compile_s"] > 0
    assert cold["total_s"] >= cold["prefill"]["compile_s"] + sum(d["compile_s"] for d in cold["decode"].values())
    assert warm["cache_hits"] == 2 + len(methods.split(",")) and all(d["cache_hit"] for d in warm["decode"].values())
    bad = subprocess.run([*compile_bench, *grouped[:-1], "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--plans-per-prefill: 0 must be >= 1" in bad.stderr
    refused = subprocess.run([*compile_bench, *args], capture_output=True, text=True)  # h2o:r25 has no section here
    assert refused.returncode == 2 and "'h2o:r25'" in refused.stderr


def test_prefill_gflop_counts_two_flops_per_weight_per_token_plus_causal_attention():
    """The analytic count against the model's own weights: every layer kernel is used once per token (2 flops per
    multiply-add), attention is causal (query t sees t + 1 keys), and only the last token gets logits."""
    from flax import nnx

    from pask_jax.experiments.bench.prefill import prefill_gflop
    from pask_jax.models.decoder import Decoder, ModelConfig

    cfg = ModelConfig.tiny("qwen2", vocab_size=256)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    kernels = sum(
        v.get_value().size for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if path[-1] == "kernel"
    )
    tokens = 10
    attention = cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * sum(t + 1 for t in range(tokens))
    logits = 2 * cfg.hidden_size * cfg.vocab_size  # tied embeddings: the embedding matrix, once
    assert prefill_gflop(cfg, tokens) * 1e9 == pytest.approx(2 * kernels * tokens + attention + logits)

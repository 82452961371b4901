"""`pask-jax bench decode`: the long-prompt option's prompts and the decode step's memory roofline arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model

from pask_jax.experiments.bench import decode
from pask_jax.experiments.bench.workloads import category_prompts
from pask_jax.factory import make_engine
from pask_jax.models.decoder import ModelConfig
from pask_jax.runtime.shapes import length_bucket


def test_decode_step_roofline_by_hand():
    cfg = ModelConfig("hand", 100, 16, 32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)
    # KV bytes per token: 2 layers * 2 KV heads * 8 dims * 2 (K, V) * 4 bytes = 256.
    # Mean live tokens over decode steps 1..4 of 5 new tokens: (10 + 2.5) + (20 + 2.5) = 35 -> 8960 KV bytes.
    # Tied: 1000 weight bytes + 8960 = 9960 bytes at 1e-3 GB/s (1e6 B/s) -> 9.96 ms.
    weights = {"bytes": 1000, "embedding_bytes": 400, "lm_head_tied": True}
    roof = decode.decode_step_roofline(cfg, weights, [10, 20], 5, 4, 1e-3)
    assert roof["kv_bytes_per_token"] == 256 and roof["kv_tokens_mean_step"] == 35 and roof["weight_bytes"] == 1000
    assert roof["kv_bytes"] == 8960 and roof["bytes"] == 9960 and roof["roofline_step_ms"] == pytest.approx(9.96)
    fractions = decode.roofline_fractions(roof, {"ours": {"tpot_ms": 19.92}, "transformers": {"tpot_ms": 9.96}})
    assert fractions == {"ours": 0.5, "transformers": 1.0}
    # Untied: the 400-byte embedding (100 rows of 4 bytes) is only looked up, 2 rows -> 1000 - 400 + 8 = 608.
    untied = decode.decode_step_roofline(cfg, weights | {"lm_head_tied": False}, [10, 20], 5, 4, 1e-3)
    assert untied["weight_bytes"] == 608 and untied["bytes"] == 608 + 8960


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_counts_every_parameter_once(tied):
    # tiny qwen2, V=256 D=64 F=128 N=4 K=2 H=16, with q/k/v biases: embedding 256*64 = 16384; per layer
    # q 4096+64, k 2048+32, v 2048+32, o 4096, mlp 3*64*128 = 24576, two norms 128 -> 37120; final norm 64.
    params = 16384 + 2 * 37120 + 64 + (0 if tied else 256 * 64)  # an untied LM head adds V*D
    weights = decode.weight_bytes(tiny_model("qwen2", tie_embeddings=tied))
    assert weights["parameters"] == params and weights["bytes"] == 4 * params
    assert weights["lm_head_tied"] is tied and weights["embedding_bytes"] == 4 * 16384 and weights["dtype"] == "float32"


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_weight_is_vocab_by_hidden(tied):
    model = tiny_model("qwen3", tie_embeddings=tied)
    w = decode.lm_head_weight(model)
    assert w.shape == (256, 64)  # f[V, D]
    assert np.array_equal(w, model.embed.embedding[...]) is tied


def test_copy_bandwidth_reports_both_measurements():
    out = decode.copy_bandwidth(4 << 20, 2)
    best = [out[k]["best_gb_s"] for k in ("numpy_copyto", "xla_scale_donated")]
    assert out["gb_s"] == max(best) and min(best) > 0 and out["array_mib"] == 4.0 and out["repeats"] == 2
    assert all(out[k]["best_gb_s"] >= out[k]["median_gb_s"] for k in ("numpy_copyto", "xla_scale_donated"))


def test_long_prompts_fill_to_the_target_and_reach_both_sides_unchanged(qwen_tok, tiny_qwen_vocab):
    target = 512
    prompts = decode.bench_prompts(qwen_tok, "simple_python", 3, target)
    short = category_prompts(qwen_tok, "simple_python", 3)
    assert decode.bench_prompts(qwen_tok, "simple_python", 3) == short  # no target: the BFCL prompts as they are
    for ids, own in zip(prompts, short, strict=True):
        assert 0.85 * target <= len(ids) <= target and length_bucket(len(ids)) == target and len(ids) > len(own)
    # the same ids on both sides: our engine right-pads them into its bucket, transformers left-pads them
    shape = make_engine(tiny_qwen_vocab).batch_shape([len(p) for p in prompts], 32)
    tokens, lengths, _ = shape.pad(prompts)
    hf_ids, hf_mask = decode.left_pad(prompts, decode.PAD_ID)
    assert shape.prompt_bucket == target and list(lengths[:3]) == [len(p) for p in prompts]
    for i, ids in enumerate(prompts):
        assert tokens[i, : len(ids)].tolist() == ids == hf_ids[i, hf_ids.shape[1] - len(ids) :].tolist()
        assert int(hf_mask[i].sum()) == len(ids)
    # each long prompt still asks its own item's question over its own functions
    item = decode.bfcl.load_category("simple_python")[0]
    text = qwen_tok.decode(prompts[0])
    assert item["question"][0][-1]["content"] in text and f'"name": "{item["function"][0]["name"]}"' in text
    assert prompts == decode.bench_prompts(qwen_tok, "simple_python", 3, target)  # seeded: the same every run


def test_long_prompt_target_below_the_bfcl_prompt_is_an_error(qwen_tok):
    with pytest.raises(ValueError, match=r"simple_python_0: .* > prompt_tokens=100"):
        decode.bench_prompts(qwen_tok, "simple_python", 1, 100)


def test_prompt_tokens_and_bandwidth_options():
    args = decode.build_parser().parse_args(["--prompt-tokens", "2048", "--bandwidth-mib", "64"])
    cfg = decode.config_from_args(args)
    assert cfg.prompt_tokens == 2048 and cfg.bandwidth_mib == 64
    assert decode.config_from_args(decode.build_parser().parse_args([])).prompt_tokens is None
    for bad in ({"prompt_tokens": 0}, {"bandwidth_mib": 0}):
        with pytest.raises(ValueError, match="must be >= 1|need bandwidth"):
            decode.DecodeConfig(**bad)


def test_summary_table_has_a_row_per_batch():
    side = {"prefill_tok_s": 80.0, "decode_tok_s": 4.0, "tpot_ms": 250.0}
    entry = {
        "batch": 8,
        "prompt_lengths": {"min": 2000, "mean": 2020.4, "max": 2035},
        "ours": side | {"padding": {"batch_bucket": 8, "length_bucket": 2048}},
        "transformers": side | {"decode_tok_s": 2.0, "tpot_ms": 500.0},
        "ours_over_transformers": {"prefill_speedup": 1.0, "decode_speedup": 2.0},
        "roofline": {"roofline_step_ms": 100.0, "fraction": {"ours": 0.4, "transformers": 0.2}},
    }
    roofline = {"bandwidth": {"gb_s": 25.0}, "weights": {"bytes": 2e9, "dtype": "float32", "lm_head_tied": True}}
    lines = decode.summary_table({"roofline": roofline, "results": [entry]}).splitlines()
    assert len(lines) == 3 and "25.0 GB/s" in lines[0] and "2000.0 MB float32 (LM head tied" in lines[0]
    row = lines[2].split()
    assert row[0] == "8" and "8x2048" in row and "0.400/0.200" in row and "2.00" in row
    assert np.isclose(float(row[1].split("/")[0]), 2020)  # mean prompt length, rounded

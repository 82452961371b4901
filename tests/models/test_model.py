"""Parity of the NNX decoder with transformers' PyTorch models, and of the GGUF path with safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pask_jax import attention as attention_ops
from pask_jax.models.decoder import PRESETS, ModelConfig
from pask_jax.models.loading import (
    CheckpointError,
    config_from_hf,
    hf_key_table,
    load_gguf,
    load_hf_checkpoint,
)

FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}


def tiny_torch_model(family: str, tie: bool, seed: int = 0) -> torch.nn.Module:
    """A tiny random transformers model with every parameter (biases and norms too) randomised."""
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
        rope_theta=5e4,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2)
            if "norm" in name:  # norm scales near 1, like trained models
                p.add_(1.0)
    return model


def torch_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


TOKENS = np.random.RandomState(0).randint(0, 128, (2, 19))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [True, False])
def test_safetensors_parity(tmp_path: Path, family: str, tie: bool):
    ref_model = tiny_torch_model(family, tie)
    ref_model.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path)
    assert model.config.tie_embeddings == tie
    assert model.config.qkv_bias == (family == "qwen2") and model.config.qk_norm == (family == "qwen3")
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), torch_logits(ref_model, TOKENS), atol=1e-4)


def test_sharded_checkpoint(tmp_path: Path):
    ref_model = tiny_torch_model("qwen3", tie=False)
    ref_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_hf_checkpoint(tmp_path)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), torch_logits(ref_model, TOKENS), atol=1e-4)


def test_padding_and_positions():
    """A left-padded row with shifted positions gives the same logits as the unpadded sequence."""
    from flax import nnx

    from pask_jax.models.decoder import Decoder

    model = Decoder(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(0))
    seq = jnp.asarray(TOKENS[:1, :10])
    alone = model(seq)
    padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), seq], axis=1)
    positions = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), jnp.arange(10)[None]], axis=1)
    valid = jnp.arange(13)[None] >= 3
    out = model(padded, positions, valid)
    np.testing.assert_allclose(np.asarray(out[:, 3:]), np.asarray(alone), atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


# ---- GGUF ----


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to llama Q/K rows (the loader must undo it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    rest = HF_TO_GGUF.get(rest) or rest.replace("self_attn.", "attn_").replace("mlp.", "ffn_")
    return f"blk.{layer}.{rest.replace('_proj', '')}"


def write_gguf(ref_model: torch.nn.Module, family: str, path: Path) -> None:
    """Write a transformers model as a llama.cpp-style GGUF; MLP weights Q8_0-quantized, the rest F32.

    The quantized weights are copied back into `ref_model` dequantized, so both hold identical numbers.
    """
    cfg = ref_model.config
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family == "qwen3":
        writer.add_key_length(cfg.head_dim)
    state = ref_model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        w = tensor.numpy().astype(np.float32)
        if ".mlp." in name:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)
            with torch.no_grad():
                ref_model.get_parameter(name).copy_(torch.from_numpy(deq))
            writer.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if family == "llama" and ("q_proj.weight" in name or "k_proj.weight" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("llama", True), ("qwen3", False)])
def test_gguf_matches_safetensors(tmp_path: Path, family: str, tie: bool):
    ref_model = tiny_torch_model(family, tie)
    write_gguf(ref_model, family, tmp_path / "model.gguf")
    ref_model.save_pretrained(tmp_path / "hf")
    from_gguf = load_gguf(tmp_path / "model.gguf")
    from_hf = load_hf_checkpoint(tmp_path / "hf")
    assert from_gguf.config.tie_embeddings == tie
    tokens = jnp.asarray(TOKENS)
    np.testing.assert_allclose(np.asarray(from_gguf(tokens)), np.asarray(from_hf(tokens)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(from_gguf(tokens)), torch_logits(ref_model, TOKENS), atol=1e-4)


# ---- configs and errors ----


def test_config_reads_transformers_4_and_5_rope_keys():
    base = dict(
        model_type="qwen3",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    )
    assert config_from_hf(base | {"rope_theta": 1e6}).rope_theta == 1e6
    assert config_from_hf(base | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}).rope_theta == 5e5
    with pytest.raises(CheckpointError, match="rope_theta"):
        config_from_hf(base)
    with pytest.raises(CheckpointError, match="yarn"):
        config_from_hf(base | {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointError, match="unknown architecture 'mistral'"):
        config_from_hf(base | {"model_type": "mistral", "rope_theta": 1e6})


def test_presets_match_their_key_tables():
    qwen = PRESETS["qwen2.5-coder-0.5b"]
    assert (qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim, qwen.qkv_bias) == (24, 14, 2, 64, True)
    table = hf_key_table(PRESETS["qwen3-8b"])
    assert "lm_head.weight" in table and "model.layers.35.self_attn.k_norm.weight" in table
    assert "lm_head.weight" not in hf_key_table(PRESETS["qwen3-0.6b"])


def test_missing_tensor_and_shape_mismatch_are_named(tmp_path: Path):
    from safetensors.numpy import load_file, save_file

    tiny_torch_model("qwen3", tie=True).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    bad = dict(weights)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf_checkpoint(tmp_path)
    bad = dict(weights)
    bad["model.norm.weight"] = np.ones(65, np.float32)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \(65,\)"):
        load_hf_checkpoint(tmp_path)


def test_unknown_gguf_architecture(tmp_path: Path):
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="unknown architecture 'mamba'"):
        load_gguf(tmp_path / "x.gguf")


def test_not_a_checkpoint_directory(tmp_path: Path):
    (tmp_path / "weights.json").write_text(json.dumps({}))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("t", "s", "chunk", "causal"),
    [
        (48, 48, 16, True),  # whole blocks, causal skipping
        (45, 45, 16, True),  # padded to blocks of 16
        (48, 48, 16, False),
        (7, 61, 16, False),  # fewer queries than keys (a cached suffix), key blocks only
        (1, 40, 16, False),  # a decode-sized query
        (20, 20, 64, True),  # one block, no loops
    ],
)
def test_blocked_attention_equals_reference(monkeypatch, t, s, chunk, causal):
    """Attention in blocks with an online softmax equals the one-block definition, padding and skipped blocks
    included; a query with no visible key gets zeros in both."""
    keys = jax.random.split(jax.random.key(3), 3)
    b, n, kv, h = 2, 4, 2, 8
    q = jax.random.normal(keys[0], (b, t, n, h))
    k, v = (jax.random.normal(key, (b, s, kv, h)) for key in keys[1:])
    lengths = jnp.array([s, max(s - 17, 0)])  # row 1 has padding keys; at t = s its last queries see only padding
    qpos, kpos = jnp.arange(s - t, s), jnp.arange(s)
    mask = (kpos[None, None, :] < lengths[:, None, None]) & (qpos[None, :, None] >= kpos[None, None, :])
    mask = mask & (lengths[:, None, None] > qpos[None, :, None])  # padding queries see nothing
    monkeypatch.setattr(attention_ops, "QUERY_CHUNK", chunk)
    blocked = attention_ops.attention(q, k, v, mask, causal=causal)
    np.testing.assert_allclose(
        np.asarray(blocked), np.asarray(attention_ops.reference_attention(q, k, v, mask)), rtol=1e-5, atol=1e-6
    )
    if causal:  # the same causal mask over valid keys, built per block from the key validity alone
        key_valid = kpos[None, :] < lengths[:, None]
        built = attention_ops.attention(q, k, v, causal=True, key_valid=key_valid)
        reference = attention_ops.reference_attention(
            q, k, v, (qpos[None, :, None] >= kpos[None, None, :]) & key_valid[:, None]
        )
        np.testing.assert_allclose(np.asarray(built), np.asarray(reference), rtol=1e-5, atol=1e-6)
    assert not np.asarray(blocked)[1, np.asarray(qpos) >= int(lengths[1])].any()


@pytest.mark.parametrize("start, t, s, chunk", [(0, 16, 48, 16), (16, 16, 48, 16), (32, 16, 48, 8), (20, 12, 40, 64)])
def test_causal_attention_of_a_prompt_chunk_equals_reference(monkeypatch, start, t, s, chunk):
    """Queries at prompt positions start .. start + t - 1 against the whole prompt's key buffer (keys after the chunk
    present but causally invisible), as chunked prefill runs them: the reference over the visible keys."""
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (2, t, 4, 8))
    k, v = (jax.random.normal(key, (2, s, 2, 8)) for key in keys[1:])
    key_valid = jnp.arange(s)[None, :] < jnp.array([s, start + t // 2])[:, None]
    monkeypatch.setattr(attention_ops, "QUERY_CHUNK", chunk)
    got = attention_ops.attention(q, k, v, causal=True, key_valid=key_valid, query_start=jnp.int32(start))
    mask = ((start + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :])[None] & key_valid[:, None]
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(attention_ops.reference_attention(q, k, v, mask)), rtol=1e-5, atol=1e-6
    )


def test_causal_attention_needs_a_key_per_query():
    q, k = jnp.zeros((1, 6, 2, 8)), jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        attention_ops.attention(q, k, k, jnp.ones((1, 6, 4), bool), causal=True)
    with pytest.raises(ValueError, match="a mask, or causal=True with key_valid"):
        attention_ops.attention(q, q, q, key_valid=jnp.ones((1, 4), bool))  # built masks are causal only

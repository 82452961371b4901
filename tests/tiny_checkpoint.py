"""A tiny random Qwen2-family checkpoint directory (config.json, safetensors, a byte-level tokenizer.json with Qwen's
chat special tokens, Qwen2.5's chat template), shared by the calibration and checkpoint tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
VOCAB = 264  # 256 bytes + the special tokens, padded as checkpoints pad their embedding rows


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are spelled in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def write_model_dir(directory: Path, seed: int = 0, layers: int = 4) -> Path:
    """A tiny random Qwen2 checkpoint directory with a byte-level tokenizer and Qwen2.5's chat template."""
    import tokenizers
    from safetensors.numpy import save_file

    from pask_jax.models.loading import config_from_hf, hf_key_table

    directory.mkdir(parents=True)
    byte_vocab = {c: b for b, c in _byte_to_unicode().items()}  # one token per byte, no merges
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=byte_vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.save(str(directory / "tokenizer.json"))
    hf = {
        "model_type": "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_theta": 1e4,
        "tie_word_embeddings": True,
        "eos_token_id": backend.token_to_id("<|im_end|>"),
    }
    (directory / "config.json").write_text(json.dumps(hf))
    cfg, rng = config_from_hf(hf), np.random.default_rng(seed)
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}

    def shape(name: str) -> tuple[int, ...]:  # HF (torch) layouts: Linear weights are [out, in]
        d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        if name.endswith("embed_tokens.weight"):
            return (cfg.vocab_size, d)
        if "norm" in name:
            return (d,)
        if "_proj" in name and "self_attn" in name:
            p = name.split("self_attn.")[1][0]
            if p == "o":
                return (d, cfg.num_heads * h)
            return (heads[p] * h, d) if name.endswith("weight") else (heads[p] * h,)
        return (d, f) if "down_proj" in name else (f, d)

    tensors = {}
    for name in hf_key_table(cfg):
        noise = rng.normal(0.0, 0.2, shape(name)).astype(np.float32)
        tensors[name] = noise + 1.0 if "norm" in name else noise  # norm scales near 1, like trained models
    save_file(tensors, directory / "model.safetensors")
    shutil.copy(DATA / "qwen2.5_instruct.jinja", directory / "chat_template.jinja")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return directory

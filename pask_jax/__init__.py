"""pask-jax: parser-aware structural KV persistence for structured generation in JAX.

Public entry points:
- `load_model(path_or_name)`: an HF checkpoint directory, a `.gguf` file, or a fetched model's name.
- `load_tokenizer(path_or_name)`: the matching tokenizer (or "qwen": the Qwen2/2.5/3 tokenizer built offline).
- `Engine`: batched prefill + jitted decode over a ragged, budget-sized KV cache.
- `generate_shared(engines, prompts)`: several engines over one model share the prompt forward (method sweeps).
"""

from __future__ import annotations

from pathlib import Path

from pask_jax.engine import Engine, Generation, SamplingConfig, generate_shared
from pask_jax.models.fetch import MODELS, fetch_model, resolve_model_path
from pask_jax.models.loading import load_model
from pask_jax.models.qwen3 import PRESETS, ModelConfig, Qwen3
from pask_jax.models.tokenizer import Tokenizer, load_tokenizer_from_path, qwen_tokenizer


def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory, a `.gguf` file or a fetched model; "qwen" builds Qwen's offline."""
    if str(path_or_name) == "qwen":
        return qwen_tokenizer()
    return load_tokenizer_from_path(resolve_model_path(path_or_name))


__all__ = [
    "MODELS",
    "PRESETS",
    "Engine",
    "Generation",
    "ModelConfig",
    "Qwen3",
    "SamplingConfig",
    "Tokenizer",
    "fetch_model",
    "generate_shared",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
]

"""pask-jax: parser-aware structural KV persistence for structured generation in JAX.

Public entry points (imported on first use, so `pask-jax fetch-model` and `--help` load no JAX):
- `LLM(model, method="pask", budget=0.33, policy="auto")`: OpenAI chat-completions requests in, `chat.completion`
  objects out, with grammar-constrained tool calls and a budget-sized KV cache.
- `Checkpoint.open(path_or_name)`: an HF checkpoint directory, a `.gguf` file, or a registered model's name -> its
  config, tokenizer, chat template, policy fingerprint and `weights(dtype, mesh)` (what every command loads through).
- `load_model(path_or_name)`: the weights alone.
- `load_tokenizer(path_or_name)`: the matching tokenizer (or "qwen": the Qwen2/2.5/3 tokenizer built offline).
- `Engine`: batched prefill + jitted decode over a ragged, budget-sized KV cache; `make_engine` builds one from a
  method name, budget and policy together.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "pask_jax.llm",
    "Checkpoint": "pask_jax.checkpoint",
    "make_engine": "pask_jax.factory",
    "Engine": "pask_jax.runtime",
    "Generation": "pask_jax.runtime",
    "SamplingConfig": "pask_jax.runtime",
    "MODELS": "pask_jax.models.fetch",
    "fetch_model": "pask_jax.models.fetch",
    "resolve_model_path": "pask_jax.models.fetch",
    "load_model": "pask_jax.models.loading",
    "PRESETS": "pask_jax.models.decoder",
    "ModelConfig": "pask_jax.models.decoder",
    "Decoder": "pask_jax.models.decoder",
    "Tokenizer": "pask_jax.models.tokenizer",
}

if TYPE_CHECKING:
    from pask_jax.checkpoint import Checkpoint
    from pask_jax.factory import make_engine
    from pask_jax.llm import LLM
    from pask_jax.models.decoder import PRESETS, Decoder, ModelConfig
    from pask_jax.models.fetch import MODELS, fetch_model, resolve_model_path
    from pask_jax.models.loading import load_model
    from pask_jax.models.tokenizer import Tokenizer
    from pask_jax.runtime import Engine, Generation, SamplingConfig


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pask_jax' has no attribute {name!r}")


def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory, a `.gguf` file or a fetched model; "qwen" builds Qwen's offline."""
    from pask_jax.models.fetch import resolve_model_path
    from pask_jax.models.tokenizer import load_tokenizer_from_path, qwen_tokenizer

    if str(path_or_name) == "qwen":
        return qwen_tokenizer()
    return load_tokenizer_from_path(resolve_model_path(path_or_name))


__all__ = [
    "LLM",
    "Checkpoint",
    "MODELS",
    "PRESETS",
    "Decoder",
    "Engine",
    "Generation",
    "ModelConfig",
    "SamplingConfig",
    "Tokenizer",
    "fetch_model",
    "load_model",
    "load_tokenizer",
    "make_engine",
    "resolve_model_path",
]

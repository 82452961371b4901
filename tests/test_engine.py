"""The engine with full KV: cached generation equals step-by-step full-forward generation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pask_jax.engine import Engine, SamplingConfig
from pask_jax.models.qwen3 import ModelConfig, Qwen3

PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 120], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model() -> Qwen3:
    return Qwen3(ModelConfig.tiny("qwen2", vocab_size=256), rngs=nnx.Rngs(3))


@nnx.jit
def full_forward(model: Qwen3, tokens: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
    return model(tokens, valid=valid)


def greedy_without_cache(model: Qwen3, prompt: list[int], steps: int, width: int = 32) -> list[int]:
    """Re-run the whole sequence (padded to one width: one compile) for every new token."""
    tokens = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(tokens)] = tokens
        logits = full_forward(model, jnp.asarray(padded), jnp.arange(width)[None] < len(tokens))
        tokens.append(int(jnp.argmax(logits[0, len(tokens) - 1])))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("use_kernel", [False, True])
def test_cached_greedy_equals_full_forward(model: Qwen3, use_kernel: bool):
    engine = Engine(model, num_groups=2, use_kernel=use_kernel, length_buckets=(16, 32))
    out = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=12))
    for prompt, gen in zip(PROMPTS, out, strict=True):
        assert gen.tokens == greedy_without_cache(model, prompt, 12)
        assert gen.finish_reason == "length" and gen.stats.generated_tokens == 12
        assert gen.stats.kept_ratio_max == pytest.approx(1.0)


def test_batch_equals_single_requests(model: Qwen3):
    engine = Engine(model, length_buckets=(16, 32))
    batch = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=8))
    for prompt, gen in zip(PROMPTS, batch, strict=True):
        assert engine.generate([prompt], SamplingConfig(max_new_tokens=8))[0].tokens == gen.tokens


def test_stop_tokens_and_sampling(model: Qwen3):
    reference = Engine(model, length_buckets=(16,)).generate(PROMPTS[:1], SamplingConfig(max_new_tokens=10))[0]
    stop = reference.tokens[3]
    engine = Engine(model, stop_token_ids=[stop], length_buckets=(16,))
    gen = engine.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=10))[0]
    assert gen.finish_reason == "stop" and gen.tokens == reference.tokens[: reference.tokens.index(stop) + 1]
    sampled = [engine.generate(PROMPTS[:2], SamplingConfig(16, temperature=1.0, top_p=0.9, seed=s)) for s in (0, 0, 1)]
    assert [g.tokens for g in sampled[0]] == [g.tokens for g in sampled[1]]  # same key, same tokens
    assert [g.tokens for g in sampled[0]] != [g.tokens for g in sampled[2]]


def test_bad_input_is_named(model: Qwen3):
    with pytest.raises(ValueError, match="exceeds the largest length bucket 16"):
        Engine(model, length_buckets=(16,)).generate([list(range(20))])
    engine = Engine(model, length_buckets=(16,), max_context=24)
    with pytest.raises(ValueError, match="context limit 24"):
        engine.generate([list(range(10))], SamplingConfig(max_new_tokens=20))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        engine.generate([[1, 300]], SamplingConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="budget=1.5"):
        Engine(model, budget=1.5)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingConfig(max_new_tokens=4))

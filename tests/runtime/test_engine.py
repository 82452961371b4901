"""The engine: cached generation equals step-by-step full-forward generation; its shapes, lowered steps, timings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pask_jax.experiments.sweep import generate_shared, prefill_groups
from pask_jax.methods import make_method
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig, mask_words
from pask_jax.runtime.step import StepInput
from pask_jax.storage import Storage, full_entry_bytes

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring: one per XLA backend compile

PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 120], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(ModelConfig.tiny("qwen2", vocab_size=256), rngs=nnx.Rngs(3))


@nnx.jit
def full_forward(model: Decoder, tokens: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
    return model(tokens, valid=valid)


def greedy_without_cache(model: Decoder, prompt: list[int], steps: int, width: int = 32) -> list[int]:
    """Re-run the whole sequence (padded to one width: one compile) for every new token."""
    tokens = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(tokens)] = tokens
        logits = full_forward(model, jnp.asarray(padded), jnp.arange(width)[None] < len(tokens))
        tokens.append(int(jnp.argmax(logits[0, len(tokens) - 1])))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("use_kernel", [False, True])
def test_cached_greedy_equals_full_forward(model: Decoder, use_kernel: bool):
    engine = Engine(model, num_groups=2, use_kernel=use_kernel, length_buckets=(16, 32))
    out = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=12))
    for prompt, gen in zip(PROMPTS, out, strict=True):
        assert gen.tokens == greedy_without_cache(model, prompt, 12)
        assert gen.finish_reason == "length" and gen.stats.generated_tokens == 12
        assert gen.stats.kept_ratio_max == pytest.approx(1.0)


def test_batch_equals_single_requests(model: Decoder):
    engine = Engine(model, length_buckets=(16, 32))
    batch = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=8))
    for prompt, gen in zip(PROMPTS, batch, strict=True):
        assert engine.generate([prompt], SamplingConfig(max_new_tokens=8))[0].tokens == gen.tokens


def test_stop_tokens_and_sampling(model: Decoder):
    reference = Engine(model, length_buckets=(16,)).generate(PROMPTS[:1], SamplingConfig(max_new_tokens=10))[0]
    stop = reference.tokens[3]
    engine = Engine(model, stop_token_ids=[stop], length_buckets=(16,))
    gen = engine.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=10))[0]
    assert gen.finish_reason == "stop" and gen.tokens == reference.tokens[: reference.tokens.index(stop) + 1]
    sampled = [engine.generate(PROMPTS[:2], SamplingConfig(16, temperature=1.0, top_p=0.9, seed=s)) for s in (0, 0, 1)]
    assert [g.tokens for g in sampled[0]] == [g.tokens for g in sampled[1]]  # same key, same tokens
    assert [g.tokens for g in sampled[0]] != [g.tokens for g in sampled[2]]


def test_bad_input_is_named(model: Decoder):
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


# ---- the engine's shapes, cache bytes, lowered steps and step timings ------------------------------------------------

_compiles = [0]


def _count_compiles(event: str, seconds: float, **kwargs) -> None:
    _compiles[0] += event == COMPILE_EVENT


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def snapkv_engine(model: Decoder) -> Engine:
    return Engine(model, method=make_method("snapkv", {}, budget=0.5), budget=0.5, length_buckets=(16, 32))


def test_batch_shape_is_what_generate_compiles(model: Decoder):
    engine = snapkv_engine(model)
    sampling = SamplingConfig(max_new_tokens=6)
    engine.generate(PROMPTS, sampling)
    shape = engine.batch_shape([len(p) for p in PROMPTS], sampling.max_new_tokens)
    assert (shape.rows, shape.padded_rows, shape.prompt_bucket, shape.new_token_bucket) == (3, 4, 16, 64)
    # the bf16 entries that 0.5 of (16 + 64) entries' bytes pay for, metadata counted, + 1 slot of slack
    h = engine.cfg.head_dim
    slots = math.ceil(0.5 * 80 * full_entry_bytes(h) / Storage().slot_entry_bytes(h)) + 1
    assert shape.capacities == engine.capacities(16, 64) == (slots, slots) and slots < 41
    before = _compiles[0]
    lowered = engine.lower(shape, sampling)
    lowered.prefill.compile(), lowered.decode.compile()
    assert _compiles[0] == before  # the executables generate built: the same arguments, shapes and statics
    lowered.decode.compile().as_text()  # an HLO dump for inspection
    other = engine.lower(engine.batch_shape([3], sampling.max_new_tokens), sampling)
    other.decode.compile()
    assert _compiles[0] == before + 1  # another batch: another executable


def test_cache_bytes_are_the_prefilled_caches_bytes(model: Decoder):
    engine = snapkv_engine(model)
    for prompts in (PROMPTS, PROMPTS[:1]):
        shape = engine.batch_shape([len(p) for p in prompts], 20)
        tokens, lengths, roles = shape.pad(prompts)
        assert tokens.shape == roles.shape == (shape.padded_rows, 16)
        assert lengths.tolist() == [len(p) for p in prompts] + [1] * (shape.padded_rows - len(prompts))
        _, caches, _ = engine.prefill(tokens, lengths, roles, shape.capacities)
        assert engine.cache_bytes(shape) == sum(x.nbytes for x in jax.tree.leaves(caches)) > 0


def test_decode_step_continues_a_prefill_as_generate_does(model: Decoder):
    engine = Engine(model, length_buckets=(16,))
    expected = engine.generate(PROMPTS[:2], SamplingConfig(max_new_tokens=4))
    shape = engine.batch_shape([len(p) for p in PROMPTS[:2]], 4)
    tokens, lengths, roles = shape.pad(PROMPTS[:2])
    logits, caches, _ = engine.prefill(tokens, lengths, roles, shape.capacities)
    current, positions, out = np.asarray(jnp.argmax(logits, -1), np.int32), lengths.copy(), []
    no_mask = np.full((shape.padded_rows, mask_words(model.config.vocab_size)), -1, np.int32)
    for _ in range(4):
        out.append(current[:2].tolist())
        step = StepInput(current, positions, np.zeros_like(lengths), lengths)  # no method inputs: none called
        current, caches, _, overflow = engine.decode_step(caches, step, no_mask, jax.random.key(0))
        current, positions = np.asarray(current), positions + 1
        assert not bool(overflow)
    assert [list(row) for row in zip(*out, strict=True)] == [g.tokens for g in expected]


def test_on_step_reports_the_prefill_and_every_decode_step(model: Decoder):
    engine = Engine(model, length_buckets=(16, 32))
    timings = []
    gens = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=7), on_step=timings.append)
    assert [t.step for t in timings] == list(range(7))  # the prefill, then 6 decode steps for 7 tokens
    assert [t.seconds for t in timings[1:]] == gens[0].stats.token_times_s
    assert timings[0].seconds == timings[0].call_seconds <= gens[0].stats.ttft_s
    assert all(0 < t.call_seconds <= t.seconds for t in timings)
    stop = gens[0].tokens[2]
    stopping = Engine(model, stop_token_ids=[stop], length_buckets=(16, 32))
    timings.clear()
    [gen] = stopping.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=7), on_step=timings.append)
    assert len(gen.tokens) == len(timings) == gen.tokens.index(stop) + 1  # no decode step after the last row stops


def test_bad_shapes_are_named(model: Decoder):
    engine = Engine(model, length_buckets=(16,), max_context=24)
    with pytest.raises(ValueError, match="at least one token"):
        engine.batch_shape([], 4)
    with pytest.raises(ValueError, match="at least one token"):
        engine.batch_shape([3, 0], 4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.batch_shape([3], 0)
    with pytest.raises(ValueError, match="context limit 24"):
        engine.batch_shape([10], 20)
    with pytest.raises(ValueError, match="largest length bucket 16"):
        engine.batch_shape([17], 4)
    shape = engine.batch_shape([3, 5], 4)
    with pytest.raises(ValueError, match="holds 2 prompts"):
        shape.pad([[1, 2, 3]])
    with pytest.raises(ValueError, match="prompt 1 has 17 tokens"):
        shape.pad([[1], list(range(17))])
    with pytest.raises(ValueError, match="1 step callbacks for 2 engines: give one per engine"):
        generate_shared([engine, engine], [[1, 2]], constraints=[None, None], on_steps=[None])
    with pytest.raises(ValueError, match="plans_per_prefill must be at least 1, got 0"):
        generate_shared([engine], [[1, 2]], plans_per_prefill=0)


@pytest.mark.parametrize(
    ("count", "size", "sizes"),
    [(27, 9, [9, 9, 9]), (10, 9, [5, 5]), (4, 3, [2, 2]), (7, 3, [2, 3, 2]), (3, 9, [3]), (1, 1, [1]), (0, 4, [])],
)
def test_prefill_groups_split_a_sweep_into_near_equal_consecutive_groups(count, size, sizes):
    groups = prefill_groups(range(count), size)
    assert [len(g) for g in groups] == sizes
    assert [i for g in groups for i in g] == list(range(count))  # every engine once, in order

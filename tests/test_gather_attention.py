"""Gather + GQA decode attention: Pallas kernel (interpret mode on CPU) vs the pure-jnp reference vs dense numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pask_jax.kernels import gather_attention, gather_attention_kernel, ref_gather_attention, validate_inputs

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_case(seed, b, k, g, h, c, s, block_size, dtype=jnp.float32):
    """Random slot pool, permuted slot tables (garbage past lengths) and ragged lengths incl. 0, 1, a block, S."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, k, g, h)), dtype)
    k_slots = jnp.asarray(rng.standard_normal((b, k, c, h)), dtype)
    v_slots = jnp.asarray(rng.standard_normal((b, k, c, h)), dtype)
    table = np.stack([rng.permutation(c)[:s] for _ in range(b * k)]).astype(np.int32)  # [B*K, S]
    lengths = rng.integers(1, s + 1, size=b * k).astype(np.int32)
    lengths[0], lengths[-1] = 0, s
    if b * k >= 4:
        lengths[1], lengths[2] = 1, block_size
    for row, n in enumerate(lengths):  # entries past lengths are "any value": make them out of range
        table[row, n:] = rng.choice([-1, c, 10**6], size=s - n)
    return q, k_slots, v_slots, jnp.asarray(table.reshape(b, k, s)), jnp.asarray(lengths.reshape(b, k))


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


# (B, K, G, H, C, S, block_size, dtype): covers batch 1/3, G 1/2/7, H 64/128, C 16/48, 2-6 blocks, f32 and bf16.
KERNEL_CASES = [
    (1, 2, 1, 64, 16, 16, 8, jnp.float32),
    (3, 2, 2, 128, 48, 32, 8, jnp.float32),
    (3, 2, 7, 64, 48, 48, 16, jnp.float32),
    (1, 3, 7, 128, 16, 16, 4, jnp.float32),
    (3, 2, 1, 128, 48, 48, 8, jnp.bfloat16),
    (1, 3, 2, 64, 48, 32, 16, jnp.bfloat16),
    (3, 2, 7, 64, 16, 16, 4, jnp.bfloat16),
]


@pytest.mark.parametrize("b,k,g,h,c,s,block_size,dtype", KERNEL_CASES)
def test_kernel_matches_reference(b, k, g, h, c, s, block_size, dtype):
    args = make_case(b * 100 + g * 10 + block_size, b, k, g, h, c, s, block_size, dtype)
    ref = ref_gather_attention(*args)
    out = gather_attention_kernel(*args, block_size=block_size, interpret=True)
    assert_close(out, ref, dtype)
    assert not np.asarray(out[0, 0], np.float32).any()  # lengths[0, 0] == 0 -> zeros


def test_kernel_tpu_interpreter_dma_simulation():
    """TPU interpreter: simulated HBM/VMEM/SMEM, DMAs and semaphores, NaN-filled uninitialized VMEM, race detection."""
    args = make_case(7, 2, 2, 7, 64, 16, 16, 4, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")
    out = gather_attention_kernel(*args, block_size=4, interpret=params)
    assert_close(out, ref_gather_attention(*args), jnp.float32)
    try:  # the race detector's verdict lives in private state; skip this part if a jax release moves it
        from jax._src.pallas.mosaic.interpret.interpret_pallas_call import races
    except ImportError:
        return
    assert races is not None and not races.races_found


def dense_last_token_attention(q, k, v):
    """numpy: the last token's attention over all T positions (causal: it sees all). q [NQ, H], k/v [NKV, T, H]."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [NQ, T, H]
    logits = np.einsum("nh,nth->nt", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("nt,nth->nh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("permute", [False, True])
def test_reference_equals_dense_attention(permute):
    rng = np.random.default_rng(3)
    b, kh, g, h, t, c, s = 2, 2, 3, 32, 20, 24, 24
    q = rng.standard_normal((b, kh * g, h)).astype(np.float32)  # last token's query heads
    k = rng.standard_normal((b, kh, t, h)).astype(np.float32)  # the sequence's K/V, positions 0..T-1
    v = rng.standard_normal((b, kh, t, h)).astype(np.float32)
    k_slots = np.zeros((b, kh, c, h), np.float32)
    v_slots = np.zeros((b, kh, c, h), np.float32)
    table = np.zeros((b, kh, s), np.int32)
    for bi in range(b):
        for hi in range(kh):
            slots = rng.permutation(c)[:t] if permute else np.arange(t)  # position p lives in slots[p]
            k_slots[bi, hi, slots], v_slots[bi, hi, slots] = k[bi, hi], v[bi, hi]
            table[bi, hi, :t] = slots
    lengths = np.full((b, kh), t, np.int32)
    out = ref_gather_attention(jnp.asarray(q.reshape(b, kh, g, h)), k_slots, v_slots, table, lengths)
    want = np.stack([dense_last_token_attention(q[bi], k[bi], v[bi]) for bi in range(b)])
    np.testing.assert_allclose(np.asarray(out).reshape(b, kh * g, h), want, atol=1e-5, rtol=1e-5)


def poison_unkept_slots(k_slots, v_slots, table, lengths):
    """k/v with NaN in every slot no table entry keeps: a kernel that reads one gives NaN."""
    kept = np.zeros(k_slots.shape[:3], bool)
    for bi, hi in np.ndindex(*lengths.shape):
        kept[bi, hi, np.asarray(table[bi, hi, : lengths[bi, hi]])] = True
    poison = jnp.asarray(~kept)[..., None]
    return jnp.where(poison, jnp.nan, k_slots), jnp.where(poison, jnp.nan, v_slots)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_zero_lengths_give_zeros_and_unkept_nan_slots_are_ignored(use_kernel):
    q, k_slots, v_slots, table, lengths = make_case(11, 2, 2, 2, 64, 16, 16, 8)
    zeros = gather_attention(
        q, k_slots, v_slots, table, jnp.zeros_like(lengths), use_kernel=use_kernel, block_size=8, interpret=True
    )
    assert not np.isnan(np.asarray(zeros)).any() and not np.asarray(zeros).any()
    # poison every slot no table entry keeps: the result must not change
    poisoned_k, poisoned_v = poison_unkept_slots(k_slots, v_slots, table, lengths)
    out = gather_attention(
        q,
        poisoned_k,
        poisoned_v,
        table,
        lengths,
        use_kernel=use_kernel,
        block_size=8,
        interpret=True,
    )
    assert_close(out, ref_gather_attention(q, k_slots, v_slots, table, lengths), jnp.float32)


def test_dispatcher_and_jit():
    args = make_case(5, 1, 2, 7, 64, 48, 32, 16)
    ref = ref_gather_attention(*args)
    jitted = jax.jit(lambda *a: gather_attention(*a, use_kernel=False))
    assert_close(jitted(*args), ref, jnp.float32)
    assert_close(gather_attention(*args, use_kernel=True, block_size=16, interpret=True), ref, jnp.float32)
    scaled = gather_attention(*args, use_kernel=True, block_size=16, interpret=True, scale=0.5)
    assert_close(scaled, ref_gather_attention(*args, scale=0.5), jnp.float32)


def test_validation_errors():
    q, k_slots, v_slots, table, lengths = make_case(0, 2, 2, 2, 64, 16, 16, 8)
    with pytest.raises(ValueError, match=r"k_slots and v_slots must match.*\(2, 2, 8, 64\)"):
        validate_inputs(q, k_slots, v_slots[:, :, :8], table, lengths)
    with pytest.raises(ValueError, match=r"q \[B, K, G, H\] = \(2, 2, 2, 32\).*disagree"):
        validate_inputs(q[..., :32], k_slots, v_slots, table, lengths)
    with pytest.raises(ValueError, match=r"lengths must be \[B, K\] = \[2, 2\], got shape \(2,\)"):
        validate_inputs(q, k_slots, v_slots, table, lengths[:, 0])
    with pytest.raises(ValueError, match="slot_table must be int32, got float32"):
        validate_inputs(q, k_slots, v_slots, table.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="q must be floating point"):
        validate_inputs(q.astype(jnp.int32), k_slots, v_slots, table, lengths)
    with pytest.raises(ValueError, match="S=16 must be a positive multiple of block_size=6"):
        gather_attention_kernel(q, k_slots, v_slots, table, lengths, block_size=6, interpret=True)
    with pytest.raises(ValueError, match="one dtype, float32 or bfloat16; got q float16, k_slots float32"):
        validate_inputs(q.astype(jnp.float16), k_slots, v_slots, table, lengths, block_size=8)
    # the reference path has no block constraint
    validate_inputs(q, k_slots, v_slots, table, lengths)
    gather_attention(q, k_slots, v_slots, table, lengths, use_kernel=False, block_size=6)

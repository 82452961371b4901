"""Gather + GQA decode attention over a slot-pool KV cache: the problem, its input checks and the pure-jnp reference.

After compression, the entries a sequence keeps for one KV head live in arbitrary slots of a fixed-capacity pool
``k_slots[b, h, :C]``; ``slot_table[b, h, :lengths[b, h]]`` names them. One decode step computes, for every query head
``g`` of the ``G`` heads sharing KV head ``h`` (GQA)::

    out[b, h, g] = softmax(q[b, h, g] . k[slots]^T * scale) @ v[slots],   slots = slot_table[b, h, :lengths[b, h]]

with zeros where ``lengths == 0``. ``ref_gather_attention`` computes it with XLA (``take_along_axis`` + masked
softmax); the Pallas kernels in ``tpu.py`` (Mosaic) and ``gpu.py`` (Triton) compute the same and are tested against it.
``validate_inputs`` holds the shape / dtype checks all three share. ``masked_softmax`` is the masked softmax the model's
full attention and the cache's pool attention share.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis where `mask` (broadcastable) is True; fully masked rows give zeros, never NaN.

    A finite fill (not -inf) keeps a fully masked row finite before it is zeroed.
    """
    return jnp.where(mask, jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1), 0.0)


def validate_inputs(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    block_size: int | None = None,  # None: no block constraint (reference path)
) -> None:
    """Raise ValueError on static (shape / dtype) problems; with `block_size`, also the constraints every kernel shares.

    Values are not checked (they may be traced): valid table entries must lie in [0, C) -- the reference turns an
    out-of-range one into NaN, a kernel's gather would read out of bounds -- and lengths beyond S count as S.
    """
    for name, x, nd in (("q", q, 4), ("k_slots", k_slots, 4), ("v_slots", v_slots, 4)):
        if x.ndim != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if k_slots.shape != v_slots.shape or k_slots.dtype != v_slots.dtype:
        raise ValueError(
            f"k_slots and v_slots must match: k_slots {tuple(k_slots.shape)} {k_slots.dtype}, "
            f"v_slots {tuple(v_slots.shape)} {v_slots.dtype}"
        )
    (b, k, _, h), (bk, kk, _, hk) = q.shape, k_slots.shape
    if (b, k, h) != (bk, kk, hk):
        raise ValueError(
            f"q [B, K, G, H] = {tuple(q.shape)} and k_slots [B, K, C, H] = {tuple(k_slots.shape)} disagree on B, K or H"
        )
    if slot_table.ndim != 3 or tuple(slot_table.shape[:2]) != (b, k):
        raise ValueError(f"slot_table must be [B, K, S] = [{b}, {k}, S], got shape {tuple(slot_table.shape)}")
    if tuple(lengths.shape) != (b, k):
        raise ValueError(f"lengths must be [B, K] = [{b}, {k}], got shape {tuple(lengths.shape)}")
    for name, x in (("slot_table", slot_table), ("lengths", lengths)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if block_size is not None:
        s = slot_table.shape[2]
        if block_size <= 0 or s % block_size:
            raise ValueError(
                f"slot_table length S={s} must be a positive multiple of block_size={block_size}; "
                "pad the table (entries past lengths are ignored) or pass a smaller block_size"
            )
        if k_slots.dtype not in _KERNEL_DTYPES or q.dtype != k_slots.dtype:
            raise ValueError(
                f"the kernel needs q and k_slots/v_slots of one dtype, float32 or bfloat16; got q {q.dtype}, "
                f"k_slots {k_slots.dtype}"
            )


def ref_gather_attention(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    scale: float | None = None,
) -> jax.Array:  # f[B, K, G, H], q.dtype
    """Pure-jnp reference: gather the kept slots, masked softmax attention, zeros where lengths == 0."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    valid = jnp.arange(slot_table.shape[-1]) < lengths[..., None]  # bool[B, K, S]
    idx = jnp.where(valid, slot_table, 0)[..., None]  # i32[B, K, S, 1]; garbage entries -> slot 0
    k = jnp.take_along_axis(k_slots, idx, axis=2).astype(jnp.float32)  # f32[B, K, S, H]
    v = jnp.take_along_axis(v_slots, idx, axis=2).astype(jnp.float32)
    v = jnp.where(valid[..., None], v, 0.0)  # masked rows never contribute, even if they hold NaN
    logits = jnp.einsum("bkgh,bksh->bkgs", q.astype(jnp.float32), k) * scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))  # rows with no valid slot: all zeros
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgs,bksh->bkgh", p / jnp.where(denom == 0, 1.0, denom), v)
    return out.astype(q.dtype)

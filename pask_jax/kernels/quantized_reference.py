"""Decode attention over QUANTIZED KV pools: the contract, the input checks, pure-jnp references and the merge.

One decode step, one query per sequence, GQA: ``q f[B, K, G, H]`` (sequences, KV heads, query heads per KV head,
head_dim) attends to the live entries of a quantized pool. Two pool layouts (formats from ``quantize.py``; the arrays
are exactly what ``quantize`` returns for a pool shaped as below, bundled as a `QuantizedBlock` each for keys and
values):

(a) **Slot pool**, per-token formats (``KVFormat(8, "int8_sym")`` or ``KVFormat(8, "fp8")``, keys and values each)::

        k.codes  i8 | f8e4m3fn[B, K, C, H]     k.scale  f16[B, K, C, 1]     (the same for v; zero is None)
        slot_table i32[B, K, S]    lengths i32[B, K]: slot_table[b, h, :lengths[b, h]] are the live slots

    Dequantized, ``k[slot] = k.codes[slot] * k.scale[slot]``. A kernel never builds that: the per-token scale is a
    scalar per slot, so it folds into the logit after the dot product and into the softmax weight before the PV
    product (as jax-llm-examples' ragged attention does for its int8 cache)::

        logit[slot] = (q . k.codes[slot]) * k.scale[slot] / sqrt(H)
        out        += (p[slot] * v.scale[slot]) * v.codes[slot]

(b) **Block pool**, KIVI (keys per channel over a block of ``Gt`` tokens, ``KVFormat(bits, "int", "channel", Gt)``;
    values per token over groups of ``gv`` channels, ``KVFormat(bits, "int", "token", gv)``; bits 2, 4 or 8)::

        k.codes u8[B, K, NB, Gt, H*bits/8]   k.scale, k.zero f16[B, K, NB, 1, H]       (packed along H)
        v.codes u8[B, K, NB, Gt, H*bits/8]   v.scale, v.zero f16[B, K, NB, Gt, H/gv]
        block_table i32[B, K, T]   nblocks i32[B, K]: block_table[b, h, :nblocks[b, h]] are the live blocks
        live bool | int[B, K, NB, Gt]: which entries of a block are live (an entry can be dead in a live block)

    A key is ``code[c] * scale[c] + zero[c]`` per channel c, the same ``scale``/``zero`` for the block's Gt tokens, so
    they fold into the query once per block instead of into every key::

        q . k_t = sum_c q[c] (code_t[c] scale[c] + zero[c]) = (q * scale) . code_t + (q . zero)

    -- one scaled query ``q_s = q * scale`` and one constant ``q . zero`` per block, added to each of its logits. A
    value is ``code * scale + zero`` per (token, group): dequantized in the kernel (it varies along both axes).

**Partial softmax state.** Each pool returns `SoftmaxPartial` ``(o, m, l)``, the state of an online softmax over its
live entries, so that a caller can attend over several pools (e.g. a full-precision recent window, a slot pool and a
block pool) in one softmax::

    m f32[B, K, G]      = max_j logit_j                     (-inf where nothing is live)
    l f32[B, K, G]      = sum_j exp(logit_j - m)            (0 where nothing is live)
    o f32[B, K, G, H]   = sum_j exp(logit_j - m) v_j        (unnormalized; 0 where nothing is live)

`merge_partials` rescales them to the common max and normalizes: ``sum_p e^{m_p - M} o_p / sum_p e^{m_p - M} l_p``
with zeros where no pool has a live entry. The references below compute the partials from `quantize.dequantize` (so
they share nothing with a kernel's folding); ``quantized_slot_tpu.py`` / ``quantized_block_tpu.py`` hold the Pallas
kernels tested against them.

Entries past ``lengths`` / ``nblocks`` are "any value" (possibly out of range); dead entries and unkept slots may hold
any bits (NaN included) in codes, scales and zeros: they never reach the result. Live table entries must be in range.
A key block's scale and zero must be finite when the block is live (they are shared by its entries).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pask_jax.kernels.quantize import KVFormat, QuantizedBlock, dequantize

_HIGHEST = jax.lax.Precision.HIGHEST
_CODE_DTYPES = {"int8_sym": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}

__all__ = [
    "SoftmaxPartial",
    "merge_partials",
    "ref_block_pool_attention",
    "ref_slot_pool_attention",
    "validate_block_pool",
    "validate_slot_pool",
]


class SoftmaxPartial(NamedTuple):
    """The online-softmax state of one pool (a pytree): see the module docstring."""

    o: jax.Array  # f32[B, K, G, H] unnormalized sum_j exp(logit_j - m) v_j
    m: jax.Array  # f32[B, K, G] running max (-inf where nothing is live)
    l: jax.Array  # noqa: E741 -- f32[B, K, G] sum_j exp(logit_j - m), the name of the papers


def _shape(x: jax.Array) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_q_and_table(
    q: jax.Array,  # f[B, K, G, H]
    table: jax.Array,  # i32[B, K, S]
    counts: jax.Array,  # i32[B, K]
    table_name: str,
    count_name: str,
) -> None:
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point [B, K, G, H], got {q.dtype} {_shape(q)}")
    b, k = q.shape[:2]
    if table.ndim != 3 or _shape(table)[:2] != (b, k):
        raise ValueError(f"{table_name} must be [B, K, S] = [{b}, {k}, S], got shape {_shape(table)}")
    if _shape(counts) != (b, k):
        raise ValueError(f"{count_name} must be [B, K] = [{b}, {k}], got shape {_shape(counts)}")
    for name, x in ((table_name, table), (count_name, counts)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


def _check_array(name: str, x: jax.Array | None, shape: tuple[int, ...], dtype=None) -> None:
    """`x` has `shape` and (when given) `dtype`; dtype None: any floating dtype."""
    if x is None:
        raise ValueError(f"{name} is missing (None)")
    if _shape(x) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(x)}")
    if dtype is None and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if dtype is not None and x.dtype != jnp.dtype(dtype):
        raise ValueError(f"{name} must be {jnp.dtype(dtype)}, got {x.dtype}")


def validate_slot_pool(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,  # codes i8 | f8e4m3fn[B, K, C, H], scale f16[B, K, C, 1]
    v: QuantizedBlock,  # the same
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
) -> None:
    """Raise ValueError on static (shape / dtype / format) problems of a slot-pool call."""
    _check_q_and_table(q, slot_table, lengths, "slot_table", "lengths")
    b, kh, _, h = q.shape
    c = k.codes.shape[2] if k.codes.ndim == 4 else None
    for name, fmt, block in (("k", k_fmt, k), ("v", v_fmt, v)):
        if fmt.kind not in _CODE_DTYPES:
            raise ValueError(f"the slot pool takes per-token formats int8_sym or fp8; {name}_fmt is {fmt}")
        _check_array(f"{name}.codes", block.codes, (b, kh, c, h), _CODE_DTYPES[fmt.kind])
        _check_array(f"{name}.scale", block.scale, (b, kh, c, 1))
        if block.zero is not None:
            raise ValueError(f"{name}.zero must be None for {fmt.kind} codes")


def validate_block_pool(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f16[B, K, NB, 1, H]
    v: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f16[B, K, NB, Gt, H/gv]
    block_table: jax.Array,  # i32[B, K, T]
    nblocks: jax.Array,  # i32[B, K]
    live: jax.Array,  # bool | int[B, K, NB, Gt]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
) -> None:
    """Raise ValueError on static (shape / dtype / format) problems of a block-pool call."""
    _check_q_and_table(q, block_table, nblocks, "block_table", "nblocks")
    b, kh, _, h = q.shape
    if k_fmt.kind != "int" or k_fmt.full or k_fmt.axis != "channel":
        raise ValueError(f"block-pool keys need an 'int' format grouped along 'channel' (KIVI), got {k_fmt}")
    if v_fmt.kind != "int" or v_fmt.full or v_fmt.axis != "token":
        raise ValueError(f"block-pool values need an 'int' format grouped along 'token' (KIVI), got {v_fmt}")
    if k.codes.ndim != 5:
        raise ValueError(f"k.codes must be [B, K, NB, Gt, H*bits/8], got shape {_shape(k.codes)}")
    nb, gt = k.codes.shape[2:4]
    if k_fmt.group != gt:
        raise ValueError(f"the key format's channel group {k_fmt.group} must equal the block's token count Gt={gt}")
    if h % v_fmt.group:
        raise ValueError(f"the value format's token group {v_fmt.group} must divide head_dim H={h}")
    for name, fmt in (("k", k_fmt), ("v", v_fmt)):
        if h * fmt.bits % 8:
            raise ValueError(f"head_dim H={h} does not pack into whole bytes at {fmt.bits} bits ({name})")
    _check_array("k.codes", k.codes, (b, kh, nb, gt, h * k_fmt.bits // 8), jnp.uint8)
    _check_array("k.scale", k.scale, (b, kh, nb, 1, h))
    _check_array("k.zero", k.zero, (b, kh, nb, 1, h))
    _check_array("v.codes", v.codes, (b, kh, nb, gt, h * v_fmt.bits // 8), jnp.uint8)
    _check_array("v.scale", v.scale, (b, kh, nb, gt, h // v_fmt.group))
    _check_array("v.zero", v.zero, (b, kh, nb, gt, h // v_fmt.group))
    if _shape(live) != (b, kh, nb, gt):
        raise ValueError(f"live must be [B, K, NB, Gt] = {(b, kh, nb, gt)}, got shape {_shape(live)}")
    if not (live.dtype == jnp.bool_ or jnp.issubdtype(live.dtype, jnp.integer)):
        raise ValueError(f"live must be bool or integer, got {live.dtype}")


def _partial(
    q: jax.Array,  # f[B, K, G, H]
    k: jax.Array,  # f32[B, K, N, H] dequantized keys
    v: jax.Array,  # f32[B, K, N, H] dequantized values
    valid: jax.Array,  # bool[B, K, N]
    scale: float,
) -> SoftmaxPartial:
    """The softmax state over the valid entries of dense (dequantized) keys and values."""
    v = jnp.where(valid[..., None], v, 0.0)  # invalid rows never contribute, even when they hold NaN
    logits = jnp.einsum("bkgh,bknh->bkgn", q.astype(jnp.float32), k, precision=_HIGHEST) * scale  # f32[B, K, G, N]
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)  # f32[B, K, G]; -inf where no entry is valid
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])  # f32[B, K, G, N]; invalid: 0
    o = jnp.einsum("bkgn,bknh->bkgh", p, v, precision=_HIGHEST)  # f32[B, K, G, H]
    return SoftmaxPartial(o, m, jnp.sum(p, axis=-1))


def ref_slot_pool_attention(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,  # codes i8 | f8e4m3fn[B, K, C, H], scale f16[B, K, C, 1]
    v: QuantizedBlock,  # the same
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    scale: float | None = None,  # None: 1 / sqrt(H)
) -> SoftmaxPartial:
    """Pure-jnp reference of the slot pool: dequantize the pool, gather the live slots, softmax state over them."""
    validate_slot_pool(q, k, v, slot_table, lengths, k_fmt=k_fmt, v_fmt=v_fmt)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    valid = jnp.arange(slot_table.shape[-1]) < lengths[..., None]  # bool[B, K, S]
    idx = jnp.where(valid, slot_table, 0)[..., None]  # i32[B, K, S, 1]; entries past lengths -> slot 0
    keys = jnp.take_along_axis(dequantize(k, k_fmt), idx, axis=2)  # f32[B, K, S, H]
    values = jnp.take_along_axis(dequantize(v, v_fmt), idx, axis=2)  # f32[B, K, S, H]
    return _partial(q, keys, values, valid, scale)


def ref_block_pool_attention(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f16[B, K, NB, 1, H]
    v: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f16[B, K, NB, Gt, H/gv]
    block_table: jax.Array,  # i32[B, K, T]
    nblocks: jax.Array,  # i32[B, K]
    live: jax.Array,  # bool | int[B, K, NB, Gt]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    scale: float | None = None,  # None: 1 / sqrt(H)
) -> SoftmaxPartial:
    """Pure-jnp reference of the block pool: dequantize, gather the live blocks, softmax state over live entries."""
    validate_block_pool(q, k, v, block_table, nblocks, live, k_fmt=k_fmt, v_fmt=v_fmt)
    b, kh, _, h = q.shape
    t, gt = block_table.shape[2], k.codes.shape[3]
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    live_block = jnp.arange(t) < nblocks[..., None]  # bool[B, K, T]
    idx = jnp.where(live_block, block_table, 0)  # i32[B, K, T]; entries past nblocks -> block 0
    keys = jnp.take_along_axis(dequantize(k, k_fmt), idx[..., None, None], axis=2)  # f32[B, K, T, Gt, H]
    values = jnp.take_along_axis(dequantize(v, v_fmt), idx[..., None, None], axis=2)  # f32[B, K, T, Gt, H]
    entry_live = jnp.take_along_axis(live, idx[..., None], axis=2) != 0  # bool[B, K, T, Gt]
    valid = (live_block[..., None] & entry_live).reshape(b, kh, t * gt)  # bool[B, K, T*Gt]
    return _partial(q, keys.reshape(b, kh, t * gt, h), values.reshape(b, kh, t * gt, h), valid, scale)


def merge_partials(parts: Sequence[SoftmaxPartial]) -> jax.Array:  # f32[B, K, G, H]
    """Normalized attention over the union of the pools whose partial states are `parts`; zeros where none is live."""
    if not parts:
        raise ValueError("merge_partials needs at least one partial")
    m = jnp.stack([p.m for p in parts])  # f32[P, B, K, G]
    m_max = jnp.max(m, axis=0)  # f32[B, K, G]; -inf where no pool has a live entry
    weight = jnp.exp(m - jnp.where(jnp.isfinite(m_max), m_max, 0.0))  # f32[P, B, K, G]; 0 for an empty pool
    denom = jnp.sum(weight * jnp.stack([p.l for p in parts]), axis=0)  # f32[B, K, G]
    num = jnp.sum(weight[..., None] * jnp.stack([p.o for p in parts]), axis=0)  # f32[B, K, G, H]
    return num / jnp.where(denom == 0, 1.0, denom)[..., None]

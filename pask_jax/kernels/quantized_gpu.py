"""Decode attention that reads QUANTIZED KV codes: Pallas kernels for GPU (the Triton backend).

The contract, the folding algebra and the references are in ``quantized_reference.py``; ``quantized_slot_tpu.py`` and
``quantized_block_tpu.py`` hold the TPU (Mosaic) kernels of the same contract. Both kernels return the partial softmax
state ``(o, m, l)`` of their pool (`SoftmaxPartial`), merged by ``merge_partials``. Layout as ``gpu.py``: grid
``(B, K)``, one program per (sequence, KV head) whose refs span that row's whole pool (a Triton ref is a pointer: only
what is indexed is read), an in-kernel ``fori_loop`` over the table whose trip count comes from ``lengths`` /
``nblocks``, online softmax in the loop carry (registers), G padded with zero query heads to
``max(16, next power of two)`` (``tl.dot``'s minimum).

- **Slot pool** (int8_sym / fp8): each step gathers ``block_size`` slots with pointer loads (``kc_ref[idx]``, idx from
  the table; masked entries read slot 0 and are zeroed), and folds the per-slot scales as the TPU kernel does:
  ``logits = (q @ codes_k^T) * k_scale * sm_scale``, ``acc += (p * v_scale) @ codes_v``. Query-major layout
  (``[G, block]`` logits): registers have no lane orientation, so row and column scales cost the same.
- **Block pool** (KIVI): each step reads one table entry (a scalar load) and loads that block's codes, scales, zeros and
  ``live`` by a dynamic leading index. Codes are unpacked in registers to channel order -- ``bytes[:, :, None] >>
  shifts`` broadcast to ``[Gt, H/per, per]`` then reshaped to ``[Gt, H]`` (Triton's reshape keeps row-major order,
  which is exactly the packing order) -- so no plane bookkeeping is needed here, unlike on TPU where that interleave is
  a lane shuffle. The per-channel key scale folds into q (``(q * scale) @ codes^T + q . zero``), values are
  dequantized in registers (group scales broadcast to their ``gv`` channels by the same broadcast + reshape).

Triton constraints, enforced by ``validate_gpu_*`` so that CPU (``interpret=True``) tests use only shapes the GPU
takes: every tensor dimension a power of two (``block_size``, H, Gt; then so are gv and H / gv), and each
``tl.dot`` dimension >= 16 (``block_size``, H, Gt; G is padded). f32 dots ask for ``HIGHEST`` (IEEE, not TF32); with
bf16 q the codes go to the MXU-equivalent tensor cores as bf16 (int8 and e4m3 codes are exact in bf16). fp8 codes need
a GPU with float8 support (sm89+) for the conversion. ``live`` as bool is converted to int32 by the wrapper.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pask_jax.kernels.gpu import MIN_DOT_DIM, padded_group_size
from pask_jax.kernels.quantize import KVFormat, QuantizedBlock
from pask_jax.kernels.quantized_reference import SoftmaxPartial, validate_block_pool, validate_slot_pool

DEFAULT_GPU_SLOT_BLOCK_SIZE = 64
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_NN = (((1,), (0,)), ((), ()))  # a @ b

__all__ = [
    "DEFAULT_GPU_SLOT_BLOCK_SIZE",
    "block_pool_attention_gpu_kernel",
    "slot_pool_attention_gpu_kernel",
    "validate_gpu_block_pool",
    "validate_gpu_slot_pool",
]


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_dims(q: jax.Array, dims: dict[str, int], dot_dims: tuple[str, ...]) -> None:
    if q.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"the GPU kernel needs q in float32 or bfloat16, got {q.dtype}")
    for name, n in dims.items():
        if not _is_pow2(n):
            raise ValueError(f"the GPU kernel needs {name} a power of two, got {n}")
    for name in dot_dims:
        if dims[name] < MIN_DOT_DIM:
            raise ValueError(f"the GPU kernel needs {name} >= {MIN_DOT_DIM} (tl.dot), got {dims[name]}")


def validate_gpu_slot_pool(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,
    v: QuantizedBlock,
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    block_size: int,
) -> None:
    """``validate_slot_pool`` plus the Triton constraints (powers of two, dot dims >= 16, S % block_size)."""
    validate_slot_pool(q, k, v, slot_table, lengths, k_fmt=k_fmt, v_fmt=v_fmt)
    _check_dims(q, {"block_size": block_size, "head dim H": q.shape[-1]}, ("block_size", "head dim H"))
    s = slot_table.shape[2]
    if s % block_size:
        raise ValueError(f"slot_table length S={s} must be a multiple of block_size={block_size}; pad the table")


def validate_gpu_block_pool(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,
    v: QuantizedBlock,
    block_table: jax.Array,  # i32[B, K, T]
    nblocks: jax.Array,  # i32[B, K]
    live: jax.Array,  # bool | int[B, K, NB, Gt]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
) -> None:
    """``validate_block_pool`` plus the Triton constraints (powers of two, dot dims >= 16)."""
    validate_block_pool(q, k, v, block_table, nblocks, live, k_fmt=k_fmt, v_fmt=v_fmt)
    dims = {"head dim H": q.shape[-1], "block tokens Gt": k.codes.shape[3]}  # gv divides H: a power of two too
    _check_dims(q, dims, ("head dim H", "block tokens Gt"))


def _precision(dtype) -> lax.Precision:
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


# ---------------------------------------------------------------------------------------------------------- slot pool


def _slot_kernel(
    table_ref,  # i32[S]            slot_table[b, h]
    lengths_ref,  # i32[1]          lengths[b, h]
    q_ref,  # f[Gp, H]              q[b, h], zero-padded to Gp query heads
    kc_ref,  # i8 | f8[C, H]        key codes of (b, h), read only by gathers
    ks_ref,  # f[C]                 key scales
    vc_ref,  # i8 | f8[C, H]        value codes
    vs_ref,  # f[C]                 value scales
    o_ref,  # f32[Gp, H]            unnormalized output
    m_ref,  # f32[Gp]
    l_ref,  # f32[Gp]
    *,
    block_size: int,
    sm_scale: float,
):
    s = table_ref.shape[0]
    length = lengths_ref[0]
    num_blocks = jnp.minimum(lax.div(length + block_size - 1, block_size), s // block_size)
    q = q_ref[...]  # f[Gp, H]
    gp, h = q.shape
    precision = _precision(q.dtype)

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry  # f32[Gp], f32[Gp], f32[Gp, H]
        offset = pl.multiple_of(j * block_size, block_size)
        valid = offset + jnp.arange(block_size, dtype=jnp.int32) < length  # bool[bs]
        idx = jnp.where(valid, table_ref[pl.ds(offset, block_size)], 0)  # i32[bs]; masked entries -> slot 0
        codes = kc_ref[idx].astype(q.dtype)  # f[bs, H]; exact
        logits = lax.dot_general(q, codes, _NT, precision=precision, preferred_element_type=jnp.float32)  # [Gp, bs]
        k_scale = ks_ref[idx].astype(jnp.float32) * sm_scale  # f32[bs]
        logits = jnp.where(valid[None, :], logits * k_scale[None, :], -jnp.inf)  # key scale folded into the logits
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=-1))  # finite: this block has a valid slot
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(logits - m_new[:, None])  # f32[Gp, bs]
        l_new = alpha * l_prev + jnp.sum(p, axis=-1)
        # value scale folded into the weights; slot 0 stands in for masked rows: zero them (it may hold NaN)
        weights = jnp.where(valid[None, :], p * vs_ref[idx].astype(jnp.float32)[None, :], 0.0)  # f32[Gp, bs]
        v_codes = jnp.where(valid[:, None], vc_ref[idx].astype(jnp.float32), 0.0).astype(q.dtype)  # f[bs, H]
        pv = lax.dot_general(
            weights.astype(q.dtype), v_codes, _NN, precision=precision, preferred_element_type=jnp.float32
        )  # f32[Gp, H]
        return m_new, l_new, alpha[:, None] * acc_prev + pv

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, h), jnp.float32))
    m, l_sum, acc = lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


@functools.partial(
    jax.jit, static_argnames=("k_fmt", "v_fmt", "block_size", "num_warps", "num_stages", "interpret", "scale")
)
def slot_pool_attention_gpu_kernel(
    q: jax.Array,  # f32 | bf16[B, K, G, H]
    k: QuantizedBlock,  # codes i8 | f8e4m3fn[B, K, C, H], scale f[B, K, C, 1]
    v: QuantizedBlock,  # the same
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    block_size: int = DEFAULT_GPU_SLOT_BLOCK_SIZE,  # slots per loop step: a power of two >= 16 dividing S
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    scale: float | None = None,  # None: 1 / sqrt(H)
) -> SoftmaxPartial:  # o f32[B, K, G, H], m / l f32[B, K, G]
    """Partial softmax state of q over the live slots of an int8_sym / fp8 slot pool (Triton; module docstring)."""
    validate_gpu_slot_pool(q, k, v, slot_table, lengths, k_fmt=k_fmt, v_fmt=v_fmt, block_size=block_size)
    b, kh, g, h = q.shape
    c, s, gp = k.codes.shape[2], slot_table.shape[2], padded_group_size(g)
    sm_scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    q_padded = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # f[B, K, Gp, H]

    def spec(*shape):  # (b, h)'s whole slice, the leading [B, K] squeezed
        return pl.BlockSpec((None, None, *shape), lambda bi, hi: (bi, hi) + (0,) * len(shape))

    o, m, l_sum = pl.pallas_call(
        functools.partial(_slot_kernel, block_size=block_size, sm_scale=sm_scale),
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, gp, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, gp), jnp.float32),
        ],
        grid=(b, kh),
        in_specs=[spec(s), spec(1), spec(gp, h), spec(c, h), spec(c), spec(c, h), spec(c)],
        out_specs=[spec(gp, h), spec(gp), spec(gp)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"slot_pool_attention_gpu_{k_fmt.kind}_{v_fmt.kind}_bs{block_size}",
    )(slot_table, lengths[..., None], q_padded, k.codes, k.scale[..., 0], v.codes, v.scale[..., 0])
    return SoftmaxPartial(o[:, :, :g], m[:, :, :g], l_sum[:, :, :g])


# --------------------------------------------------------------------------------------------------------- block pool


def _unpack(packed: jax.Array, bits: int) -> jax.Array:  # u8[Gt, H/per] -> f32[Gt, H] in channel order
    per = 8 // bits
    words = packed.astype(jnp.int32)
    if per == 1:
        return words.astype(jnp.float32)
    shifts = jnp.arange(per, dtype=jnp.int32) * bits  # i32[per]
    codes = (words[:, :, None] >> shifts[None, None, :]) & (2**bits - 1)  # i32[Gt, H/per, per]: channel i*per + r
    return codes.reshape(packed.shape[0], packed.shape[1] * per).astype(jnp.float32)


def _expand_groups(x: jax.Array, group: int) -> jax.Array:  # f[Gt, H/gv] -> f32[Gt, H]: each column `group` times
    t, n = x.shape
    return jnp.broadcast_to(x.astype(jnp.float32)[:, :, None], (t, n, group)).reshape(t, n * group)


def _block_kernel(
    table_ref,  # i32[T]            block_table[b, h]
    nblocks_ref,  # i32[1]          nblocks[b, h]
    q_ref,  # f[Gp, H]
    kc_ref,  # u8[NB, Gt, H/per_k]  key codes of (b, h)'s pool, read one block at a time
    ks_ref,  # f[NB, H]             key scale per channel
    kz_ref,  # f[NB, H]             key zero per channel
    vc_ref,  # u8[NB, Gt, H/per_v]  value codes
    vs_ref,  # f[NB, Gt, H/gv]      value scale per (token, group)
    vz_ref,  # f[NB, Gt, H/gv]      value zero
    live_ref,  # i32[NB, Gt]        live entries
    o_ref,  # f32[Gp, H]
    m_ref,  # f32[Gp]
    l_ref,  # f32[Gp]
    *,
    k_bits: int,
    v_bits: int,
    v_group: int,
    sm_scale: float,
):
    n = jnp.minimum(nblocks_ref[0], table_ref.shape[0])
    q = q_ref[...]  # f[Gp, H]
    gp, h = q.shape
    q32 = q.astype(jnp.float32)
    precision = _precision(q.dtype)

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry  # f32[Gp], f32[Gp], f32[Gp, H]
        blk = table_ref[j]  # a live block (j < nblocks)
        live = live_ref[blk] != 0  # bool[Gt]
        q_s = (q32 * ks_ref[blk].astype(jnp.float32)[None, :]).astype(q.dtype)  # per-channel key scale folded into q
        codes = _unpack(kc_ref[blk], k_bits).astype(q.dtype)  # f[Gt, H]; exact
        logits = lax.dot_general(q_s, codes, _NT, precision=precision, preferred_element_type=jnp.float32)
        shift = jnp.sum(q32 * kz_ref[blk].astype(jnp.float32)[None, :], axis=-1)  # f32[Gp]: q . zero
        logits = jnp.where(live[None, :], (logits + shift[:, None]) * sm_scale, -jnp.inf)  # f32[Gp, Gt]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=-1))  # -inf while nothing live was seen
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a block of dead entries: no inf - inf
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(logits - m_safe[:, None])  # f32[Gp, Gt]
        l_new = alpha * l_prev + jnp.sum(p, axis=-1)
        v_codes = _unpack(vc_ref[blk], v_bits)  # f32[Gt, H]
        values = v_codes * _expand_groups(vs_ref[blk], v_group) + _expand_groups(vz_ref[blk], v_group)
        values = jnp.where(live[:, None], values, 0.0).astype(q.dtype)  # dead rows 0 (their scales may be NaN)
        pv = lax.dot_general(p.astype(q.dtype), values, _NN, precision=precision, preferred_element_type=jnp.float32)
        return m_new, l_new, alpha[:, None] * acc_prev + pv

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, h), jnp.float32))
    m, l_sum, acc = lax.fori_loop(0, n, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


@functools.partial(jax.jit, static_argnames=("k_fmt", "v_fmt", "num_warps", "num_stages", "interpret", "scale"))
def block_pool_attention_gpu_kernel(
    q: jax.Array,  # f32 | bf16[B, K, G, H]
    k: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f[B, K, NB, 1, H]
    v: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f[B, K, NB, Gt, H/gv]
    block_table: jax.Array,  # i32[B, K, T]
    nblocks: jax.Array,  # i32[B, K]
    live: jax.Array,  # bool | int[B, K, NB, Gt]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    scale: float | None = None,  # None: 1 / sqrt(H)
) -> SoftmaxPartial:  # o f32[B, K, G, H], m / l f32[B, K, G]
    """Partial softmax state of q over the live entries of the live blocks of a KIVI block pool (Triton)."""
    validate_gpu_block_pool(q, k, v, block_table, nblocks, live, k_fmt=k_fmt, v_fmt=v_fmt)
    b, kh, g, h = q.shape
    nb, gt = k.codes.shape[2:4]
    t, gp = block_table.shape[2], padded_group_size(g)
    sm_scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    q_padded = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # f[B, K, Gp, H]
    if live.dtype == jnp.bool_:
        live = live.astype(jnp.int32)

    def spec(*shape):
        return pl.BlockSpec((None, None, *shape), lambda bi, hi: (bi, hi) + (0,) * len(shape))

    n_groups = h // v_fmt.group
    o, m, l_sum = pl.pallas_call(
        functools.partial(_block_kernel, k_bits=k_fmt.bits, v_bits=v_fmt.bits, v_group=v_fmt.group, sm_scale=sm_scale),
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, gp, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, gp), jnp.float32),
        ],
        grid=(b, kh),
        in_specs=[
            spec(t),
            spec(1),
            spec(gp, h),
            spec(nb, gt, h * k_fmt.bits // 8),
            spec(nb, h),
            spec(nb, h),
            spec(nb, gt, h * v_fmt.bits // 8),
            spec(nb, gt, n_groups),
            spec(nb, gt, n_groups),
            spec(nb, gt),
        ],
        out_specs=[spec(gp, h), spec(gp), spec(gp)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"block_pool_attention_gpu_k{k_fmt.bits}_v{v_fmt.bits}_gt{gt}",
    )(
        block_table,
        nblocks[..., None],
        q_padded,
        k.codes,
        k.scale[..., 0, :],
        k.zero[..., 0, :],
        v.codes,
        v.scale,
        v.zero,
        live,
    )
    return SoftmaxPartial(o[:, :, :g], m[:, :, :g], l_sum[:, :, :g])

"""Gather + GQA decode attention over a slot-pool KV cache: a Pallas kernel for GPU (the Triton backend).

The contract (and the reference it is tested against) is in ``reference.py``: for each sequence ``b`` and KV head
``h``, the ``G`` query heads of ``h`` attend to the slots ``slot_table[b, h, :lengths[b, h]]`` of the pool
``k_slots[b, h]`` / ``v_slots[b, h]``; zeros where ``lengths == 0``. ``tpu.py`` holds the same for TPU (Mosaic).

Design, in the manner of JAX's GPU paged-attention kernel (``jax.experimental.pallas.ops.gpu.paged_attention``):

* **Grid (B, K, num_splits)**, every point independent. Each program owns one (sequence, KV head) and one contiguous
  part of its slot table, and walks that part in blocks of ``block_size`` slots with an in-kernel ``fori_loop`` whose
  trip count comes from ``lengths``: blocks at or past the length are never visited, so each visited block holds at
  least one valid slot (the running max is finite after the first one).
* **Vector gather** instead of DMAs: the table block is read as a vector ``i32[block_size]`` and the K/V rows are
  loaded with ``k_ref[idx]`` -- Triton turns this into one load through a tensor of pointers (``[block_size, H]``).
  The whole ``[C, H]`` pool of (b, h) is the ref's block, but a Triton ref is only a pointer: nothing is read except
  the gathered rows.
* **Online softmax** in the loop carry (running max ``m``, denominator ``l``, f32 numerator ``[G, H]``), all in
  registers. With ``num_splits > 1`` each program writes its unnormalised partial (numerator, ``m``, ``l``) and XLA
  merges the splits (rescale by ``exp(m - max m)``, sum, divide): more programs when ``B * K`` alone would leave most
  SMs idle (e.g. 16 programs on a 132-SM H200).
* Masking: slots at or past ``lengths`` get logit ``-inf``; their table entries (any value, possibly out of range)
  are replaced by slot 0 *before* the gather, because a Triton load has no bounds check, and the gathered V rows are
  zeroed so a NaN in slot 0 cannot leak through ``0 * NaN``. A (b, h) with ``lengths == 0`` visits no block: zeros.

Why it differs from the TPU kernel: the Triton lowering has no scalar prefetch (no SMEM), no scratch buffers that
outlive a grid step and no manual DMAs/semaphores; each grid point is one CUDA block (CTA) with its state in registers.
So the slot walk is a loop inside the kernel rather than a grid axis, the table is vector data rather than SMEM
scalars, and rows arrive by pointer gathers rather than one DMA per row.

Triton constraints and what this module does about them:

* every array a kernel loads or computes must have a power-of-two size, and ``tl.dot`` needs each of its dims to be
  >= 16: ``block_size`` and ``H`` must be powers of two >= 16 (checked, ValueError otherwise); ``G`` is padded with
  zero query heads to ``max(16, next_power_of_two(G))`` before the call and the padding sliced off after (the pad
  is a copy of ``q``, tiny next to the cache).
* the Triton lowering maps ``Precision.DEFAULT`` on f32 operands to TF32: the f32 dots ask for ``HIGHEST`` (IEEE);
  bf16 dots are bf16 MMAs accumulating in f32. The softmax weights are cast to V's dtype for the PV product (as in
  JAX's kernel), so bf16 results carry bf16 rounding of the weights (within the bf16 test tolerance).
* ``num_warps`` / ``num_stages`` are passed through ``CompilerParams``; the defaults are untuned guesses.

Off-GPU run it with ``interpret=True`` (HLO interpreter, CPU): it checks the indexing and the math, not the Triton
lowering -- the constraints above are enforced by ``validate_gpu_inputs`` so that CPU tests use only shapes the GPU
accepts.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pask_jax.kernels.reference import validate_inputs

DEFAULT_GPU_BLOCK_SIZE = 64
MIN_DOT_DIM = 16  # tl.dot: every dim of both operands >= 16

__all__ = [
    "DEFAULT_GPU_BLOCK_SIZE",
    "gather_attention_gpu_kernel",
    "padded_group_size",
    "validate_gpu_inputs",
]


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def padded_group_size(g: int) -> int:
    """Query heads per KV head as the kernel sees them: a power of two, at least 16 (tl.dot's minimum)."""
    return max(MIN_DOT_DIM, 1 << (g - 1).bit_length())


def validate_gpu_inputs(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    block_size: int,
    num_splits: int = 1,
) -> None:
    """``validate_inputs`` (shapes, dtypes, S % block_size) plus the Triton constraints; raises ValueError."""
    validate_inputs(q, k_slots, v_slots, slot_table, lengths, block_size=block_size)
    if not _is_pow2(block_size) or block_size < MIN_DOT_DIM:
        raise ValueError(f"the GPU kernel needs block_size a power of two >= {MIN_DOT_DIM}, got {block_size}")
    h = q.shape[-1]
    if not _is_pow2(h) or h < MIN_DOT_DIM:
        raise ValueError(f"the GPU kernel needs head dim H a power of two >= {MIN_DOT_DIM}, got H={h}")
    s = slot_table.shape[2]
    if num_splits < 1 or s % (num_splits * block_size):
        raise ValueError(
            f"slot_table length S={s} must split into num_splits={num_splits} parts of whole blocks of "
            f"block_size={block_size}"
        )


def _kernel(
    table_ref,  # i32[S // num_splits]   this split's part of slot_table[b, h]
    lengths_ref,  # i32[1]               lengths[b, h]
    q_ref,  # f[Gp, H]                   q[b, h], zero-padded to Gp query heads
    k_ref,  # f[C, H]                    k_slots[b, h], read only by gathers
    v_ref,  # f[C, H]                    v_slots[b, h]
    o_ref,  # f[Gp, H]: q.dtype normalised output, or f32 partial numerator when split
    *stat_refs,  # when split: f32[Gp] running max m, f32[Gp] denominator l
    block_size: int,
    scale: float,
    precision: lax.Precision,
):
    part_len = table_ref.shape[0]
    start = pl.program_id(2) * part_len  # first table position of this split
    length = lengths_ref[0]
    remaining = jnp.maximum(length - start, 0)  # valid slots from this split's start on
    num_blocks = jnp.minimum(lax.div(remaining + block_size - 1, block_size), part_len // block_size)
    q = q_ref[...]  # f[Gp, H]
    gp, h = q.shape

    def body(j, carry):
        m_prev, l_prev, acc_prev = carry  # f32[Gp], f32[Gp], f32[Gp, H]
        offset = pl.multiple_of(j * block_size, block_size)
        valid = start + offset + jnp.arange(block_size, dtype=jnp.int32) < length  # bool[bs]
        idx = jnp.where(valid, table_ref[pl.ds(offset, block_size)], 0)  # i32[bs]; entries past lengths -> slot 0
        k = k_ref[idx]  # f[bs, H] gathered rows
        v = v_ref[idx]  # f[bs, H]
        dims = (((1,), (1,)), ((), ()))  # contract H
        logits = lax.dot_general(q, k, dims, precision=precision, preferred_element_type=jnp.float32)  # f32[Gp, bs]
        logits = jnp.where(valid[None, :], logits * scale, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=-1))  # finite: this block has a valid slot
        alpha = jnp.exp(m_prev - m_new)  # 0 on the first block (m_prev = -inf)
        p = jnp.exp(logits - m_new[:, None])  # f32[Gp, bs]; masked columns 0
        l_new = alpha * l_prev + jnp.sum(p, axis=-1)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # slot 0 stands in for masked rows: drop any NaN it holds
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # f32[Gp, H]
        return m_new, l_new, alpha[:, None] * acc_prev + pv

    init = (
        jnp.full((gp,), -jnp.inf, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
        jnp.zeros((gp, h), jnp.float32),
    )
    m, denom, acc = lax.fori_loop(0, num_blocks, body, init)
    if stat_refs:  # split: XLA merges the partials
        m_ref, l_ref = stat_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom
    else:
        o_ref[...] = (acc / jnp.where(denom == 0, 1.0, denom)[:, None]).astype(o_ref.dtype)


def _merge_splits(
    acc: jax.Array,  # f32[P, B, K, Gp, H] partial numerators
    m: jax.Array,  # f32[P, B, K, Gp] partial running maxima (-inf: split saw no valid slot)
    l_part: jax.Array,  # f32[P, B, K, Gp] partial denominators
) -> jax.Array:  # f32[B, K, Gp, H]
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp(m - jnp.where(jnp.isfinite(m_max), m_max, 0.0))  # 0 for empty splits; all empty: all 0
    denom = jnp.sum(weight * l_part, axis=0)
    num = jnp.sum(weight[..., None] * acc, axis=0)
    return num / jnp.where(denom == 0, 1.0, denom)[..., None]


@functools.partial(
    jax.jit, static_argnames=("block_size", "num_splits", "num_warps", "num_stages", "interpret", "scale")
)
def gather_attention_gpu_kernel(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    block_size: int = DEFAULT_GPU_BLOCK_SIZE,  # slots per loop step: a power of two >= 16 dividing S // num_splits
    num_splits: int = 1,  # parts of the slot axis run as separate programs, merged by XLA
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    scale: float | None = None,
) -> jax.Array:  # f[B, K, G, H], q.dtype
    """Pallas/Triton gather + GQA decode attention (see the module docstring)."""
    validate_gpu_inputs(q, k_slots, v_slots, slot_table, lengths, block_size=block_size, num_splits=num_splits)
    b, k, g, h = q.shape
    c, s = k_slots.shape[2], slot_table.shape[2]
    gp, part_len = padded_group_size(g), s // num_splits
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    q_padded = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # f[B, K, Gp, H]

    in_specs = [
        pl.BlockSpec((None, None, part_len), lambda bi, hi, si: (bi, hi, si)),  # slot_table
        pl.BlockSpec((None, None, 1), lambda bi, hi, si: (bi, hi, 0)),  # lengths[..., None]
        pl.BlockSpec((None, None, gp, h), lambda bi, hi, si: (bi, hi, 0, 0)),  # q
        pl.BlockSpec((None, None, c, h), lambda bi, hi, si: (bi, hi, 0, 0)),  # k_slots
        pl.BlockSpec((None, None, c, h), lambda bi, hi, si: (bi, hi, 0, 0)),  # v_slots
    ]
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, k, gp, h), q.dtype)
        out_specs = pl.BlockSpec((None, None, gp, h), lambda bi, hi, si: (bi, hi, 0, 0))
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, b, k, gp, h), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, b, k, gp), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, b, k, gp), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, gp, h), lambda bi, hi, si: (si, bi, hi, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (si, bi, hi, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (si, bi, hi, 0)),
        ]
    out = pl.pallas_call(
        functools.partial(_kernel, block_size=block_size, scale=scale, precision=precision),
        out_shape=out_shape,
        grid=(b, k, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"gather_attention_gpu_bs{block_size}_p{num_splits}",
    )(slot_table, lengths[..., None], q_padded, k_slots, v_slots)
    if num_splits > 1:
        out = _merge_splits(*out).astype(q.dtype)
    return out[:, :, :g]

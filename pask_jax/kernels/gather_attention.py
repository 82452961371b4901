"""Structure-conditioned gather + GQA decode attention over a slot-pool KV cache.

After compression, the entries a sequence keeps for one KV head live in arbitrary slots of a fixed-capacity pool
``k_slots[b, h, :C]``; ``slot_table[b, h, :lengths[b, h]]`` names them. One decode step computes, for every query head
``g`` of the ``G`` heads sharing KV head ``h`` (GQA)::

    out[b, h, g] = softmax(q[b, h, g] . k[slots]^T * scale) @ v[slots],   slots = slot_table[b, h, :lengths[b, h]]

Two implementations with the same contract:

* ``ref_gather_attention``: pure jnp (``take_along_axis`` + masked softmax). XLA path, the default off TPU, and the
  reference the kernel is tested against.
* ``gather_attention_kernel``: a Pallas kernel written for TPU (Mosaic). Design and why:

  - **Grid (B, K, S // block_size)**, the last axis "arbitrary" (a reduction): each (sequence, KV head) walks its slot
    table one block at a time, so VMEM holds one ``[block_size, H]`` K/V block whatever the capacity.
  - **Scalar prefetch** of ``slot_table`` and ``lengths`` (flattened, into SMEM before the grid runs): the kernel needs
    them as *scalars* to compute DMA addresses and to skip work; they are data, so they cannot go into index maps of
    blocked specs the way a dense layout would.
  - **Manual DMA gather**: ``k_slots`` / ``v_slots`` stay in HBM (``memory_space=pl.ANY``); for each valid slot of the
    block one row is copied HBM -> VMEM with ``make_async_copy``. All copies start, then K is awaited and the logits
    computed while the V copies are still in flight. Only the valid rows of the block are copied.
  - **Online softmax** (running max ``m``, denominator ``l``, f32 accumulator in VMEM scratch): one pass over the
    blocks, no ``[S]``-sized logits buffer, exact result. Blocks at or past ``lengths`` are skipped (``pl.when``), the
    tail of the last block masked; a (sequence, head) with ``lengths == 0`` yields zeros, never NaN.
  - f32 or bf16 inputs; products accumulate in f32, output in ``q.dtype``.

  TPU caveats (unverified here, CPU only): the flattened table lives in SMEM, so ``B*K*S`` int32 must fit there (SMEM
  is small, on the order of 1 MiB or less; long tables would move to per-block SMEM BlockSpecs); single-row DMAs into
  a bf16 VMEM buffer hit packed (16, 128) tiles; there is no cross-block double buffering yet (JAX's paged-attention
  kernel prefetches the next block's pages).

``gather_attention_gpu_kernel`` (``gather_attention_gpu.py``) is the same contract for GPU (Pallas' Triton backend).

``gather_attention(..., use_kernel=...)`` is the single switch the engine uses. On CPU run the kernel with
``interpret=True`` (HLO interpreter) or ``interpret=pltpu.InterpretParams()`` (TPU interpreter that simulates memory
spaces, DMAs and semaphores) -- for correctness only, it is slow.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

DEFAULT_BLOCK_SIZE = 128
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def validate_inputs(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    block_size: int | None = None,  # None: no block constraint (reference path)
) -> None:
    """Raise ValueError on static (shape / dtype) problems.

    Values are not checked (they may be traced): valid table entries must lie in [0, C) -- the reference turns an
    out-of-range one into NaN, the kernel's DMA would read out of bounds -- and lengths beyond S count as S.
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


def _kernel(
    slot_table_ref,  # SMEM i32[B*K*S]   (scalar prefetch)
    lengths_ref,  # SMEM i32[B*K]        (scalar prefetch)
    q_ref,  # VMEM [G, H]
    k_hbm,  # ANY/HBM [B, K, C, H]
    v_hbm,  # ANY/HBM [B, K, C, H]
    o_ref,  # VMEM [G, H]
    k_buf,  # VMEM [block_size, H] scratch
    v_buf,  # VMEM [block_size, H] scratch
    m_ref,  # VMEM f32[G, 1] running max
    l_ref,  # VMEM f32[G, 1] running denominator
    acc_ref,  # VMEM f32[G, H] running numerator
    sems,  # DMA semaphores [2]: K, V
    *,
    block_size: int,
    scale: float,
):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_heads, table_len = pl.num_programs(1), pl.num_programs(2) * block_size
    row = b * num_heads + h
    length = lengths_ref[row]
    start = i * block_size

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(start < length)
    def _block():
        n = jnp.minimum(block_size, length - start)  # valid rows in this block, >= 1

        def copy(j, hbm, buf, sem):  # one slot row, HBM -> VMEM row j of the block
            slot = slot_table_ref[row * table_len + start + j]
            return pltpu.make_async_copy(hbm.at[b, h, pl.ds(slot, 1)], buf.at[pl.ds(j, 1)], sem)

        def start_all(j, carry):
            copy(j, k_hbm, k_buf, sems.at[0]).start()
            copy(j, v_hbm, v_buf, sems.at[1]).start()
            return carry

        def wait(hbm, buf, sem):
            def body(j, carry):
                copy(j, hbm, buf, sem).wait()
                return carry

            lax.fori_loop(0, n, body, 0)

        lax.fori_loop(0, n, start_all, 0)
        wait(k_hbm, k_buf, sems.at[0])  # K ready; V copies still in flight
        dims = (((1,), (1,)), ((), ()))  # contract H
        logits = lax.dot_general(q_ref[...], k_buf[...], dims, preferred_element_type=jnp.float32) * scale  # [G, bs]
        logits = jnp.where(lax.broadcasted_iota(jnp.int32, logits.shape, 1) < n, logits, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=-1, keepdims=True))  # finite: n >= 1
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(logits - m_new)  # f32[G, bs], masked columns 0
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
        m_ref[...] = m_new
        wait(v_hbm, v_buf, sems.at[1])
        v = v_buf[...].astype(jnp.float32)  # rows >= n are stale VMEM: zero them (0 * NaN would be NaN)
        v = jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, 0) < n, v, 0.0)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        denom = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(denom == 0, 1.0, denom)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "interpret", "scale"))
def gather_attention_kernel(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    interpret: bool | pltpu.InterpretParams = False,
    scale: float | None = None,
) -> jax.Array:  # f[B, K, G, H], q.dtype
    """Pallas gather + GQA decode attention (see the module docstring)."""
    validate_inputs(q, k_slots, v_slots, slot_table, lengths, block_size=block_size)
    b, k, g, h = q.shape
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    qo_spec = pl.BlockSpec((None, None, g, h), lambda b, kh, i, *_: (b, kh, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, k, slot_table.shape[2] // block_size),
        in_specs=[qo_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=qo_spec,
        scratch_shapes=[
            pltpu.VMEM((block_size, h), k_slots.dtype),
            pltpu.VMEM((block_size, h), v_slots.dtype),
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, h), jnp.float32),
            pltpu.SemaphoreType.DMA((2,)),
        ],
    )
    return pl.pallas_call(
        functools.partial(_kernel, block_size=block_size, scale=scale),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(slot_table.reshape(-1), lengths.reshape(-1), q, k_slots, v_slots)


def gather_attention(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    use_kernel: bool | None = None,  # None: the Pallas kernel on TPU, the XLA reference elsewhere; True: see below
    block_size: int = DEFAULT_BLOCK_SIZE,
    interpret: bool | pltpu.InterpretParams = False,
    scale: float | None = None,
) -> jax.Array:  # f[B, K, G, H], q.dtype
    """Decode attention over the kept slots; the one switch between the Pallas kernels and the XLA reference.

    ``use_kernel=True`` compiled (``interpret`` false) on a GPU backend runs the Triton kernel
    ``gather_attention_gpu_kernel`` (``block_size`` a power of two >= 16); otherwise the TPU kernel, compiled on TPU
    or interpreted anywhere (so interpreted calls behave alike on every backend).
    """
    if use_kernel is None:
        use_kernel = jax.default_backend() == "tpu"
    if use_kernel and not interpret and jax.default_backend() == "gpu":
        from pask_jax.kernels.gather_attention_gpu import gather_attention_gpu_kernel  # imports this module

        return gather_attention_gpu_kernel(q, k_slots, v_slots, slot_table, lengths, block_size=block_size, scale=scale)
    if use_kernel:
        return gather_attention_kernel(
            q, k_slots, v_slots, slot_table, lengths, block_size=block_size, interpret=interpret, scale=scale
        )
    validate_inputs(q, k_slots, v_slots, slot_table, lengths)
    return ref_gather_attention(q, k_slots, v_slots, slot_table, lengths, scale=scale)

"""Gather + GQA decode attention over a slot-pool KV cache: a Pallas kernel for TPU (Mosaic).

The contract (and the reference it is tested against) is in ``reference.py``. Design and why:

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

Memory limits, checked by ``validate_tpu_inputs`` before Mosaic sees the call: the whole flattened table
(``B*K*S`` int32) and ``lengths`` sit in SMEM, which is small (``SMEM_LIMIT_BYTES``); the K/V block buffers, the
accumulators and the double-buffered q / output blocks sit in VMEM (``VMEM_LIMIT_BYTES``). Both are counted with the
(sublane, 128-lane) tile padding of VMEM; SMEM arrays are counted unpadded, and Mosaic keeps a few scalars of its own
there, so a table right at the limit may still fail. A longer table would move to per-block SMEM BlockSpecs.

TPU caveats (unverified here, CPU only): single-row DMAs into a bf16 VMEM buffer hit packed (16, 128) tiles; there is
no cross-block double buffering yet (JAX's paged-attention kernel prefetches the next block's pages).

On CPU run it with ``interpret=True`` (HLO interpreter) or ``interpret=pltpu.InterpretParams()`` (TPU interpreter
that simulates memory spaces, DMAs and semaphores) -- for correctness only, it is slow.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pask_jax.kernels.reference import validate_inputs

DEFAULT_TPU_BLOCK_SIZE = 128
SMEM_LIMIT_BYTES = 1 << 20  # SMEM per TensorCore on TPU v4 and later (v2 / v3: 16 KiB)
VMEM_LIMIT_BYTES = 16 << 20  # Mosaic's default scoped VMEM limit on v4 / v5 (v6e: 32 MiB)
_LANES = 128

__all__ = [
    "DEFAULT_TPU_BLOCK_SIZE",
    "SMEM_LIMIT_BYTES",
    "VMEM_LIMIT_BYTES",
    "gather_attention_kernel",
    "kernel_memory_bytes",
    "validate_tpu_inputs",
]


def _vmem_bytes(rows: int, cols: int, dtype) -> int:
    """Bytes of a [rows, cols] VMEM array, padded to whole (sublane, lane) tiles: (8, 128) for f32, (16, 128) bf16."""
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = 8 * 4 // itemsize
    return -(-rows // sublanes) * sublanes * -(-cols // _LANES) * _LANES * itemsize


def kernel_memory_bytes(
    batch: int, kv_heads: int, group: int, head_dim: int, table_len: int, block_size: int, dtype
) -> tuple[int, int]:
    """(SMEM, VMEM) bytes one call of ``gather_attention_kernel`` holds for these sizes."""
    smem = 4 * (batch * kv_heads * table_len + batch * kv_heads)  # flattened slot table + lengths, int32
    vmem = (
        2 * _vmem_bytes(block_size, head_dim, dtype)  # K and V block buffers
        + 2 * _vmem_bytes(group, 1, jnp.float32)  # running max m, denominator l
        + _vmem_bytes(group, head_dim, jnp.float32)  # f32 accumulator
        + 2 * 2 * _vmem_bytes(group, head_dim, dtype)  # q and output blocks, double-buffered by the pipeline
    )
    return smem, vmem


def validate_tpu_inputs(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    block_size: int,
) -> None:
    """``validate_inputs`` (shapes, dtypes, S % block_size) plus the SMEM / VMEM footprint; raises ValueError."""
    validate_inputs(q, k_slots, v_slots, slot_table, lengths, block_size=block_size)
    b, k, g, h = q.shape
    s = slot_table.shape[2]
    smem, vmem = kernel_memory_bytes(b, k, g, h, s, block_size, q.dtype)
    if smem > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"the TPU kernel's scalar-prefetched slot table B*K*S = {b}*{k}*{s} int32 plus lengths needs {smem} bytes "
            f"of SMEM, over its {SMEM_LIMIT_BYTES}-byte limit; use a smaller batch or a smaller cache capacity "
            "(a shorter slot table), or the XLA reference path (use_kernel=False)"
        )
    if vmem > VMEM_LIMIT_BYTES:
        raise ValueError(
            f"the TPU kernel's K/V block buffers [block_size={block_size}, H={h}] {q.dtype} and accumulators "
            f"[G={g}, H={h}] need {vmem} bytes of VMEM, over its {VMEM_LIMIT_BYTES}-byte limit; pass a smaller "
            "block_size"
        )


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
    block_size: int = DEFAULT_TPU_BLOCK_SIZE,  # slots per grid step; must divide S
    interpret: bool | pltpu.InterpretParams = False,
    scale: float | None = None,
) -> jax.Array:  # f[B, K, G, H], q.dtype
    """Pallas/Mosaic gather + GQA decode attention (see the module docstring)."""
    validate_tpu_inputs(q, k_slots, v_slots, slot_table, lengths, block_size=block_size)
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

"""Decode attention that reads QUANTIZED KV codes from a slot pool: a Pallas kernel for TPU (Mosaic), dequantizing
inside the kernel; and what both quantized TPU kernels share (this one and ``quantized_block_tpu.py``'s).

The contract, the two pool layouts, the folding algebra and the references are in ``quantized_reference.py``; each
kernel returns the partial softmax state ``(o, m, l)`` of its pool (`SoftmaxPartial`), merged by ``merge_partials``.
Neither kernel materializes a dequantized K or V in HBM: codes travel as codes (1 byte, or 2 / 4 bits, per element).

**Slot pool** (``slot_pool_attention_kernel``; int8_sym / fp8 codes, one scale per slot). As ``tpu.py``: grid
``(B, K, S // block_size)``, the slot table and lengths scalar-prefetched into SMEM, one row DMA per live slot HBM ->
VMEM (codes ``[1, H]`` and scale ``[1, 1]``, keys and values), online softmax across the grid's last axis, blocks
past ``lengths`` skipped. The math is laid out *key-major* -- logits ``[block_size, G]`` (``codes @ q^T``) -- because
gathered rows arrive as rows: a per-slot scale is then a ``[block_size, 1]`` column that broadcasts along lanes,
with no transpose:

    logits = (codes_k @ q^T) * k_scale * sm_scale          (the scale folded into the logits, not into K)
    acc^T  = alpha * acc^T + codes_v^T @ (p * v_scale)     (the scale folded into the weights, not into V)

so the running max / denominator are ``[1, G]`` rows and the accumulator is ``acc^T f32[H, G]``; the wrapper
transposes the (tiny) output. Codes are cast to q's dtype for the MXU: exact (int8 and e4m3 are bf16-representable).

**Mosaic constraints and what they shaped** (TPU-only behaviour is unverified here: CPU interpret mode only; the
block pool's own are in ``quantized_block_tpu.py``):

- Scales and zeros are read as stored (f16) and widened in the kernel. f16 vector support differs between TPU
  generations; where Mosaic rejects f16, store them as f32 (or bf16) -- the kernels take any float dtype. Widening in
  the wrapper instead would cost an extra HBM pass over them every step, about as many bytes as 2-bit codes.
- Row DMAs of int8 / fp8 codes and f16 scales write single rows of packed (32, 128) / (16, 128) VMEM tiles (as
  ``tpu.py``'s bf16 path); fp8 -> f32 conversion needs a TPU generation with fp8 support. The ``[1, G]`` rows and the
  ``[H, G]`` accumulator use G of 128 lanes (G is 1-8 in practice).
- The PV product contracts the token axis of both operands (``v^T @ p``): Mosaic lowers it with a transposed-LHS
  matmul (an XLU transpose of a ``[block, H]`` f32 tile per step).
- SMEM holds the flattened table and counts (``B*K*S + B*K`` int32), checked against ``SMEM_LIMIT_BYTES``.

On CPU run them with ``interpret=True`` or ``interpret=pltpu.InterpretParams()``: for correctness only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pask_jax.kernels.quantize import KVFormat, QuantizedBlock
from pask_jax.kernels.quantized_reference import SoftmaxPartial, validate_slot_pool

DEFAULT_SLOT_BLOCK_SIZE = 128
SMEM_LIMIT_BYTES = 1 << 20  # SMEM per TensorCore on TPU v4 and later
NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b^T
TN = (((0,), (0,)), ((), ()))  # contract the first dims: a^T @ b

__all__ = [
    "DEFAULT_SLOT_BLOCK_SIZE",
    "SMEM_LIMIT_BYTES",
    "slot_pool_attention_kernel",
    "validate_tpu_slot_pool",
]


def check_kernel_q(q: jax.Array) -> None:
    if q.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"the kernel needs q in float32 or bfloat16, got {q.dtype}")


def check_smem(table: jax.Array, what: str) -> None:
    b, k, s = table.shape
    smem = 4 * (b * k * s + b * k)
    if smem > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"the TPU kernel's scalar-prefetched {what} B*K*S = {b}*{k}*{s} int32 plus counts needs {smem} bytes of "
            f"SMEM, over its {SMEM_LIMIT_BYTES}-byte limit; use a smaller batch or a shorter table"
        )


def validate_tpu_slot_pool(
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
    """``validate_slot_pool`` plus the kernel's constraints (q dtype, S % block_size, SMEM); raises ValueError."""
    validate_slot_pool(q, k, v, slot_table, lengths, k_fmt=k_fmt, v_fmt=v_fmt)
    check_kernel_q(q)
    s = slot_table.shape[2]
    if block_size <= 0 or s % block_size:
        raise ValueError(
            f"slot_table length S={s} must be a positive multiple of block_size={block_size}; pad the table "
            "(entries past lengths are ignored) or pass a smaller block_size"
        )
    check_smem(slot_table, "slot table")


# ---------------------------------------------------------------------------------------------------------- slot pool


def _slot_kernel(
    table_ref,  # SMEM i32[B*K*S]      (scalar prefetch)
    lengths_ref,  # SMEM i32[B*K]      (scalar prefetch)
    q_ref,  # VMEM f[G, H]
    kc_hbm,  # ANY i8 | f8[B, K, C, H]  key codes
    ks_hbm,  # ANY f[B, K, C, 1]        key scales
    vc_hbm,  # ANY i8 | f8[B, K, C, H]  value codes
    vs_hbm,  # ANY f[B, K, C, 1]        value scales
    o_ref,  # VMEM f32[H, G]            unnormalized output, transposed
    m_out,  # VMEM f32[1, G]
    l_out,  # VMEM f32[1, G]
    kc_buf,  # VMEM [bs, H] scratch: gathered key codes
    ks_buf,  # VMEM [bs, 1]
    vc_buf,  # VMEM [bs, H]
    vs_buf,  # VMEM [bs, 1]
    m_ref,  # VMEM f32[1, G] running max
    l_ref,  # VMEM f32[1, G] running denominator
    acc_ref,  # VMEM f32[H, G] running numerator, transposed
    sems,  # DMA semaphores [4]: key codes, key scales, value codes, value scales
    *,
    block_size: int,
    sm_scale: float,
):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    table_len = pl.num_programs(2) * block_size
    row = b * pl.num_programs(1) + h
    length = lengths_ref[row]
    start = i * block_size
    pairs = ((kc_hbm, kc_buf), (ks_hbm, ks_buf), (vc_hbm, vc_buf), (vs_hbm, vs_buf))

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(start < length)
    def _block():
        n = jnp.minimum(block_size, length - start)  # live rows in this block, >= 1

        def copy(j, which):  # slot row j of the block, HBM -> VMEM, for one of the four arrays
            slot = table_ref[row * table_len + start + j]
            hbm, buf = pairs[which]
            return pltpu.make_async_copy(hbm.at[b, h, pl.ds(slot, 1)], buf.at[pl.ds(j, 1)], sems.at[which])

        def start_all(j, carry):
            for which in range(4):
                copy(j, which).start()
            return carry

        def wait(which):
            def body(j, carry):
                copy(j, which).wait()
                return carry

            lax.fori_loop(0, n, body, 0)

        lax.fori_loop(0, n, start_all, 0)
        wait(0)
        wait(1)  # keys ready; the value copies are still in flight
        valid = lax.broadcasted_iota(jnp.int32, (block_size, 1), 0) < n  # bool[bs, 1]; rows >= n are stale VMEM
        q = q_ref[...]  # f[G, H]
        codes = kc_buf[...].astype(q.dtype)  # f[bs, H]; exact: int8 / e4m3 codes are bf16 values
        logits = lax.dot_general(codes, q, NT, preferred_element_type=jnp.float32)  # f32[bs, G]
        k_scale = ks_buf[...].astype(jnp.float32) * sm_scale  # f32[bs, 1]
        logits = jnp.where(valid, logits * k_scale, -jnp.inf)  # the key scale folded into the logits
        m_prev = m_ref[...]  # f32[1, G]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=0, keepdims=True))  # finite: n >= 1
        alpha = jnp.exp(m_prev - m_new)  # f32[1, G]; 0 on the first live block
        p = jnp.exp(logits - m_new)  # f32[bs, G]; stale rows 0
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=0, keepdims=True)
        m_ref[...] = m_new
        wait(2)
        wait(3)
        # the value scale folded into the weights; stale rows zeroed in both operands (0 * NaN would be NaN)
        weights = jnp.where(valid, p * vs_buf[...].astype(jnp.float32), 0.0)  # f32[bs, G]
        v_codes = jnp.where(valid, vc_buf[...].astype(jnp.float32), 0.0)  # f32[bs, H]
        pv = lax.dot_general(v_codes, weights, TN, preferred_element_type=jnp.float32)  # f32[H, G]
        acc_ref[...] = alpha * acc_ref[...] + pv

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = acc_ref[...]
        m_out[...] = m_ref[...]
        l_out[...] = l_ref[...]


@functools.partial(jax.jit, static_argnames=("k_fmt", "v_fmt", "block_size", "interpret", "scale"))
def slot_pool_attention_kernel(
    q: jax.Array,  # f32 | bf16[B, K, G, H]
    k: QuantizedBlock,  # codes i8 | f8e4m3fn[B, K, C, H], scale f[B, K, C, 1]
    v: QuantizedBlock,  # the same
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    block_size: int = DEFAULT_SLOT_BLOCK_SIZE,  # slots per grid step; must divide S
    interpret: bool | pltpu.InterpretParams = False,
    scale: float | None = None,  # None: 1 / sqrt(H)
) -> SoftmaxPartial:  # o f32[B, K, G, H], m / l f32[B, K, G]
    """Partial softmax state of q over the live slots of an int8_sym / fp8 slot pool (see the module docstring)."""
    validate_tpu_slot_pool(q, k, v, slot_table, lengths, k_fmt=k_fmt, v_fmt=v_fmt, block_size=block_size)
    b, kh, g, h = q.shape
    sm_scale = 1.0 / math.sqrt(h) if scale is None else float(scale)

    def spec(*shape):  # one (sequence, KV head) per grid step, the leading [B, K] squeezed
        return pl.BlockSpec((None, None, *shape), lambda bi, hi, i, *_: (bi, hi) + (0,) * len(shape))

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kh, slot_table.shape[2] // block_size),
        in_specs=[spec(g, h), hbm, hbm, hbm, hbm],
        out_specs=[spec(h, g), spec(1, g), spec(1, g)],
        scratch_shapes=[
            pltpu.VMEM((block_size, h), k.codes.dtype),
            pltpu.VMEM((block_size, 1), k.scale.dtype),
            pltpu.VMEM((block_size, h), v.codes.dtype),
            pltpu.VMEM((block_size, 1), v.scale.dtype),
            pltpu.VMEM((1, g), jnp.float32),
            pltpu.VMEM((1, g), jnp.float32),
            pltpu.VMEM((h, g), jnp.float32),
            pltpu.SemaphoreType.DMA((4,)),
        ],
    )
    o_t, m, l_sum = pl.pallas_call(
        functools.partial(_slot_kernel, block_size=block_size, sm_scale=sm_scale),
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, h, g), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, 1, g), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, 1, g), jnp.float32),
        ],
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=f"slot_pool_attention_{k_fmt.kind}_{v_fmt.kind}_bs{block_size}",
    )(slot_table.reshape(-1), lengths.reshape(-1), q, k.codes, k.scale, v.codes, v.scale)
    return SoftmaxPartial(jnp.swapaxes(o_t, -1, -2), m[:, :, 0], l_sum[:, :, 0])

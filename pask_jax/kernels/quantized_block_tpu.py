"""Decode attention that reads QUANTIZED KV codes from a KIVI block pool: a Pallas kernel for TPU (Mosaic),
dequantizing inside the kernel.

The contract, the pool layouts, the folding algebra and the references are in ``quantized_reference.py``; like the
slot-pool kernel (``quantized_slot_tpu.py``) this one returns its pool's partial softmax state ``(o, m, l)``
(`SoftmaxPartial`) and never materializes a dequantized K or V in HBM: codes travel as 2 / 4 bits per element.

**Block pool** (``block_pool_attention_kernel``; KIVI). Grid ``(B, K, T)`` over the block table; blocks are contiguous,
so they come through ordinary BlockSpecs whose index maps read the scalar-prefetched table (as JAX's paged attention
does): the pipeline double-buffers the next block's codes, scales, zeros and ``live`` while this one computes. A step
past ``nblocks`` maps to the last live block (the same block index: no new DMA) and is skipped. Per live block:

- **Unpacking without a lane shuffle.** A byte holds ``per = 8 / bits`` codes, channel ``i * per + r`` in bits
  ``r * bits`` of byte ``i``. Putting channels back in order would interleave lanes (a gather Mosaic does not do
  cheaply). Instead the codes stay in *planes*: ``plane_r = (bytes >> r * bits) & (2^bits - 1)`` is ``[Gt, H/per]``
  and holds channels ``r, per + r, 2 per + r, ...``. Logits are sums over channels, so they are sums over planes:
  ``logits = sum_r plane_r @ q_s[:, r::per]^T``. The wrapper hands the kernel q split the same way
  (``q_planar [per, G, H/per]``, a copy of q, tiny), and the kernel writes ``o`` in value planes, which the wrapper
  puts back in channel order.
- **Keys: scale and zero folded into q.** The block's per-channel ``scale``, ``zero`` ``[1, H]`` are picked into plane
  order by a 0/1 selection matmul (``[1, H] @ [H, H/per]``, exact at ``HIGHEST``), then
  ``logits = sum_r plane_r @ (q_r * scale_r)^T + sum_r zero_r @ q_r^T`` -- the second term one ``[1, G]`` constant
  per block, added to every logit.
- **Values dequantized in VMEM.** Per value plane, ``v_r = plane_r * scale + zero`` with the group's scale / zero
  expanded to the plane's columns by another 0/1 matmul (``[Gt, H/gv] @ [H/gv, H/per]``; column ``i`` of every plane
  is in group ``i // (gv / per)``, so one expansion serves all planes), then ``acc_r^T += v_r^T @ p``.
- ``live [Gt, 1]`` masks the logits (``-inf``) and the value rows (0: a dead entry may hold NaN scales). A live block
  whose entries are all dead leaves the state unchanged (its max is ``-inf``: guarded, no NaN).

**Mosaic constraints and what they shaped** (TPU-only behaviour is unverified here: CPU interpret mode only; those
both kernels share -- scales read as stored, the transposed PV product, SMEM -- are in ``quantized_slot_tpu.py``):

- ``dot_general`` rejects unsigned operands: packed ``u8`` codes are widened to ``i32`` for the shifts and masks
  (32-bit VPU ops everywhere) and converted to f32 before any dot.
- Block shapes must be (8, 128)-divisible or span the full dims: every block here spans its array's last two dims
  (``[Gt, H*bits/8]`` codes, ``[1, H]`` key scales, ``[Gt, H/gv]`` value scales, ``[Gt, 1]`` live), and ``live`` is
  reshaped to ``[B, K, NB, Gt, 1]`` (free) so its block is a column. Narrow minor dims (``H*bits/8`` = 16 bytes for
  H = 64 at 2 bits; ``H/gv`` = 2) are legal but pad to 128 lanes in VMEM: a 2-bit block occupies the VMEM of a
  full-width one, and the ``[Gt, H/per]`` planes use 1/per of each vreg's lanes. Packing along tokens instead (a
  different pool layout) would fill the lanes; this layout is the one ``quantize`` produces.
- ``live`` as bool is converted to int32 by the wrapper (Mosaic has no bool memrefs): pass int32 to skip that pass.

On CPU run it with ``interpret=True`` or ``interpret=pltpu.InterpretParams()``: for correctness only.
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
from pask_jax.kernels.quantized_reference import SoftmaxPartial, validate_block_pool
from pask_jax.kernels.quantized_slot_tpu import NT, TN, check_kernel_q, check_smem

_HIGHEST = lax.Precision.HIGHEST

__all__ = ["block_pool_attention_kernel", "validate_tpu_block_pool"]


def validate_tpu_block_pool(
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
    """``validate_block_pool`` plus the kernel's constraints (q dtype, whole bytes per value group, SMEM)."""
    validate_block_pool(q, k, v, block_table, nblocks, live, k_fmt=k_fmt, v_fmt=v_fmt)
    check_kernel_q(q)
    per = 8 // v_fmt.bits
    if v_fmt.group % per:
        raise ValueError(
            f"the kernel needs the value group {v_fmt.group} to be a multiple of the {per} codes a byte holds at "
            f"{v_fmt.bits} bits (a byte never straddles two groups)"
        )
    check_smem(block_table, "block table")


def _select_columns(rows: int, cols: int, stride: int, offset: int) -> jax.Array:  # f32[rows, cols]
    """0/1 matrix with a 1 at (stride * j + offset, j): ``x @ it`` picks columns offset, offset + stride, ..."""
    r = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return (r == c * stride + offset).astype(jnp.float32)


def _expand_groups(groups: int, cols: int, width: int) -> jax.Array:  # f32[groups, cols]
    """0/1 matrix with a 1 at (j // width, j): ``x @ it`` repeats each column of x `width` times."""
    r = lax.broadcasted_iota(jnp.int32, (groups, cols), 0)
    c = lax.broadcasted_iota(jnp.int32, (groups, cols), 1)
    return (r * width <= c).astype(jnp.float32) * (c < (r + 1) * width).astype(jnp.float32)


def _planes(packed: jax.Array, bits: int):  # u8[Gt, H/per] -> per x f32[Gt, H/per]
    """The code planes of packed bytes: plane r holds the codes in bits r*bits (channels r, per + r, ...)."""
    words = packed.astype(jnp.int32)  # 32-bit shifts and masks (Mosaic: no unsigned dots, 8-bit VPU ops vary)
    mask = 2**bits - 1
    return [((words >> (r * bits)) & mask).astype(jnp.float32) for r in range(8 // bits)]


def _block_kernel(
    table_ref,  # SMEM i32[B*K*T]   (scalar prefetch)
    nblocks_ref,  # SMEM i32[B*K]   (scalar prefetch)
    q_ref,  # VMEM f[per_k, G, H/per_k]  q in key planes
    kc_ref,  # VMEM u8[Gt, H/per_k]      key codes of this block
    ks_ref,  # VMEM f[1, H]              key scale per channel
    kz_ref,  # VMEM f[1, H]              key zero per channel
    vc_ref,  # VMEM u8[Gt, H/per_v]      value codes
    vs_ref,  # VMEM f[Gt, H/gv]          value scale per (token, group)
    vz_ref,  # VMEM f[Gt, H/gv]          value zero per (token, group)
    live_ref,  # VMEM int[Gt, 1]         live entries of the block
    o_ref,  # VMEM f32[per_v, H/per_v, G] unnormalized output, in value planes, transposed
    m_out,  # VMEM f32[1, G]
    l_out,  # VMEM f32[1, G]
    m_ref,  # VMEM f32[1, G] running max
    l_ref,  # VMEM f32[1, G] running denominator
    acc_ref,  # VMEM f32[per_v, H/per_v, G] running numerator
    *,
    k_bits: int,
    v_bits: int,
    v_group: int,
    sm_scale: float,
):
    b, i = pl.program_id(0), pl.program_id(2)
    row = b * pl.num_programs(1) + pl.program_id(1)
    h = ks_ref.shape[-1]
    per_k, per_v = 8 // k_bits, 8 // v_bits

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(i < nblocks_ref[row])
    def _block():
        live = live_ref[...].astype(jnp.int32) != 0  # bool[Gt, 1]
        k_scale = ks_ref[...].astype(jnp.float32)  # f32[1, H]
        k_zero = kz_ref[...].astype(jnp.float32)  # f32[1, H]
        logits = None  # f32[Gt, G]
        shift = None  # f32[1, G]: q . zero, the same for every entry of the block
        for r, plane in enumerate(_planes(kc_ref[...], k_bits)):  # plane f32[Gt, H/per_k]
            pick = _select_columns(h, h // per_k, per_k, r)  # f32[H, H/per_k]
            scale_r = jnp.dot(k_scale, pick, precision=_HIGHEST, preferred_element_type=jnp.float32)  # [1, H/per]
            zero_r = jnp.dot(k_zero, pick, precision=_HIGHEST, preferred_element_type=jnp.float32)  # [1, H/per]
            q_r = q_ref[r].astype(jnp.float32)  # f32[G, H/per_k]
            term = lax.dot_general(plane, q_r * scale_r, NT, preferred_element_type=jnp.float32)  # f32[Gt, G]
            const = lax.dot_general(zero_r, q_r, NT, preferred_element_type=jnp.float32)  # f32[1, G]
            logits, shift = (term, const) if logits is None else (logits + term, shift + const)
        logits = jnp.where(live, (logits + shift) * sm_scale, -jnp.inf)
        m_prev = m_ref[...]  # f32[1, G]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=0, keepdims=True))  # -inf while nothing live was seen
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a block of dead entries: no inf - inf
        alpha = jnp.exp(m_prev - m_safe)  # f32[1, G]
        p = jnp.exp(logits - m_safe)  # f32[Gt, G]; dead entries 0
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=0, keepdims=True)
        m_ref[...] = m_new
        cols = h // per_v
        expand = _expand_groups(h // v_group, cols, v_group // per_v)  # f32[H/gv, H/per_v]
        v_scale = jnp.dot(vs_ref[...].astype(jnp.float32), expand, precision=_HIGHEST)  # f32[Gt, H/per_v]
        v_zero = jnp.dot(vz_ref[...].astype(jnp.float32), expand, precision=_HIGHEST)  # f32[Gt, H/per_v]
        for r, plane in enumerate(_planes(vc_ref[...], v_bits)):  # plane f32[Gt, H/per_v]
            values = jnp.where(live, plane * v_scale + v_zero, 0.0)  # dequantized; dead rows 0 (NaN scales too)
            pv = lax.dot_general(values, p, TN, preferred_element_type=jnp.float32)  # f32[H/per_v, G]
            acc_ref[r] = alpha * acc_ref[r] + pv

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = acc_ref[...]
        m_out[...] = m_ref[...]
        l_out[...] = l_ref[...]


def _block_index(b, h, i, table_ref, nblocks_ref, *, num_heads: int, table_len: int):
    """The pool block grid step (b, h, i) reads: its table entry; past nblocks the last live one (no new DMA)."""
    row = b * num_heads + h
    n = nblocks_ref[row]
    j = jnp.maximum(jnp.minimum(i, n - 1), 0)
    return jnp.where(n > 0, table_ref[row * table_len + j], 0)  # nblocks == 0: block 0, never computed on


@functools.partial(jax.jit, static_argnames=("k_fmt", "v_fmt", "interpret", "scale"))
def block_pool_attention_kernel(
    q: jax.Array,  # f32 | bf16[B, K, G, H]
    k: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f[B, K, NB, 1, H]
    v: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f[B, K, NB, Gt, H/gv]
    block_table: jax.Array,  # i32[B, K, T]
    nblocks: jax.Array,  # i32[B, K]
    live: jax.Array,  # bool | int[B, K, NB, Gt]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    interpret: bool | pltpu.InterpretParams = False,
    scale: float | None = None,  # None: 1 / sqrt(H)
) -> SoftmaxPartial:  # o f32[B, K, G, H], m / l f32[B, K, G]
    """Partial softmax state of q over the live entries of the live blocks of a KIVI block pool (module docstring)."""
    validate_tpu_block_pool(q, k, v, block_table, nblocks, live, k_fmt=k_fmt, v_fmt=v_fmt)
    b, kh, g, h = q.shape
    nb, gt = k.codes.shape[2:4]
    t = block_table.shape[2]
    per_k, per_v = 8 // k_fmt.bits, 8 // v_fmt.bits
    sm_scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    # q in key planes: q_planar[..., r, :, i] = q[..., :, i * per_k + r]
    q_planar = jnp.transpose(q.reshape(b, kh, g, h // per_k, per_k), (0, 1, 4, 2, 3))  # f[B, K, per_k, G, H/per_k]
    if live.dtype == jnp.bool_:
        live = live.astype(jnp.int32)
    live = live.reshape(b, kh, nb, gt, 1)  # int[B, K, NB, Gt, 1]: a column per block

    index = functools.partial(_block_index, num_heads=kh, table_len=t)

    def pooled(*shape):  # one pool block of the grid step's table entry
        return pl.BlockSpec(
            (None, None, None, *shape), lambda bi, hi, i, *refs: (bi, hi, index(bi, hi, i, *refs), 0, 0)
        )

    def per_row(*shape):  # one (sequence, KV head), whatever the step
        return pl.BlockSpec((None, None, *shape), lambda bi, hi, i, *_: (bi, hi) + (0,) * len(shape))

    n_groups = h // v_fmt.group
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kh, t),
        in_specs=[
            per_row(per_k, g, h // per_k),
            pooled(gt, h // per_k),
            pooled(1, h),
            pooled(1, h),
            pooled(gt, h // per_v),
            pooled(gt, n_groups),
            pooled(gt, n_groups),
            pooled(gt, 1),
        ],
        out_specs=[per_row(per_v, h // per_v, g), per_row(1, g), per_row(1, g)],
        scratch_shapes=[
            pltpu.VMEM((1, g), jnp.float32),
            pltpu.VMEM((1, g), jnp.float32),
            pltpu.VMEM((per_v, h // per_v, g), jnp.float32),
        ],
    )
    o_planar, m, l_sum = pl.pallas_call(
        functools.partial(_block_kernel, k_bits=k_fmt.bits, v_bits=v_fmt.bits, v_group=v_fmt.group, sm_scale=sm_scale),
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, per_v, h // per_v, g), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, 1, g), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, 1, g), jnp.float32),
        ],
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=f"block_pool_attention_k{k_fmt.bits}_v{v_fmt.bits}_gt{gt}",
    )(block_table.reshape(-1), nblocks.reshape(-1), q_planar, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, live)
    # o_planar[..., r, i, g] is channel i * per_v + r of query head g
    o = jnp.transpose(o_planar, (0, 1, 4, 3, 2)).reshape(b, kh, g, h)  # f32[B, K, G, H]
    return SoftmaxPartial(o, m[:, :, 0], l_sum[:, :, 0])

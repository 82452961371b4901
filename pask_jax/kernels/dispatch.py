"""The one switch between the XLA reference and the Pallas kernels of gather + GQA decode attention.

``gather_attention(..., use_kernel=False)`` is the XLA reference (``reference.ref_gather_attention``). With
``use_kernel=True`` the ``backend`` picks the kernel: ``"tpu"`` the Mosaic kernel (``tpu.py``), ``"gpu"`` the Triton
kernel (``gpu.py``), ``"cpu"`` -- there is no CPU kernel -- the TPU kernel interpreted. ``backend=None`` means
``jax.default_backend()``. A kernel runs compiled only when JAX runs on its own platform and is interpreted elsewhere
(``interpret=None``); pass ``interpret`` to choose (``pltpu.InterpretParams()`` only for the TPU kernel).

Block sizes: each backend's default is its kernel's preferred block, shrunk to fit a short table -- TPU
``min(128, S rounded up to a multiple of 8)``, GPU ``min(64, max(16, next power of two >= S))`` (Triton needs powers of
two >= 16). The slot table need not be a whole number of blocks (the cache's capacity is whatever the budget gives): the
dispatcher pads it with slot 0 to the next multiple of the block and clamps ``lengths`` to the original ``S``, so the
padding is never attended to. That costs a copy of the int32 table, not of K/V; the kernels never visit blocks past
``lengths``. An explicit ``block_size`` the kernel cannot take (e.g. a GPU block that is not a power of two >= 16)
raises the kernel's ValueError.

Quantized pools (``quantized_reference.py``): ``slot_pool_attention`` and ``block_pool_attention`` make the same switch
between the reference and the kernels of ``quantized_slot_tpu.py`` / ``quantized_block_tpu.py`` / ``quantized_gpu.py``,
and return the partial softmax state (``SoftmaxPartial``) that ``merge_partials`` combines; the slot table is padded
to whole blocks the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import pask_jax.kernels.gpu as gpu
import pask_jax.kernels.quantized_block_tpu as quantized_block_tpu
import pask_jax.kernels.quantized_gpu as quantized_gpu
import pask_jax.kernels.quantized_reference as quantized_reference
import pask_jax.kernels.quantized_slot_tpu as quantized_slot_tpu
import pask_jax.kernels.reference as reference
import pask_jax.kernels.tpu as tpu
from pask_jax.kernels.quantize import KVFormat, QuantizedBlock

BACKENDS = ("cpu", "gpu", "tpu")
_TPU_SUBLANES = 8


def kernel_block_size(backend: str, table_len: int) -> int:
    """The default block size of the kernel `gather_attention` runs on `backend` for a slot table of `table_len`."""
    if backend == "gpu":
        return min(gpu.DEFAULT_GPU_BLOCK_SIZE, max(gpu.MIN_DOT_DIM, 1 << max(table_len - 1, 0).bit_length()))
    return min(tpu.DEFAULT_TPU_BLOCK_SIZE, max(_TPU_SUBLANES, -(-table_len // _TPU_SUBLANES) * _TPU_SUBLANES))


def _pad_to_blocks(
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    block_size: int,
) -> tuple[jax.Array, jax.Array]:  # i32[B, K, S'] with S' a multiple of block_size, i32[B, K]
    s = slot_table.shape[-1]
    pad = -s % block_size
    if not pad:
        return slot_table, lengths
    # lengths beyond S count as S: clamp them so that the padding (slot 0) is never a valid entry
    return jnp.pad(slot_table, ((0, 0), (0, 0), (0, pad))), jnp.minimum(lengths, s)


def gather_attention(
    q: jax.Array,  # f[B, K, G, H]
    k_slots: jax.Array,  # f[B, K, C, H]
    v_slots: jax.Array,  # f[B, K, C, H]
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    use_kernel: bool,
    backend: str | None = None,  # "cpu" | "gpu" | "tpu"; None: jax.default_backend()
    block_size: int | None = None,  # None: the backend's default (see the module docstring); reference: ignored
    interpret: bool | pltpu.InterpretParams | None = None,  # None: compiled only on the kernel's own platform
    scale: float | None = None,  # None: 1 / sqrt(H)
) -> jax.Array:  # f[B, K, G, H], q.dtype
    """Decode attention of q over the slots ``slot_table[b, h, :lengths[b, h]]``: the XLA reference or a kernel."""
    backend = jax.default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    reference.validate_inputs(q, k_slots, v_slots, slot_table, lengths)
    if not use_kernel:
        return reference.ref_gather_attention(q, k_slots, v_slots, slot_table, lengths, scale=scale)
    platform = "gpu" if backend == "gpu" else "tpu"  # whose kernel runs
    if interpret is None:
        interpret = backend == "cpu" or jax.default_backend() != platform
    if block_size is None:
        block_size = kernel_block_size(platform, slot_table.shape[-1])
    slot_table, lengths = _pad_to_blocks(slot_table, lengths, block_size)
    if platform == "gpu":
        if not isinstance(interpret, bool):
            raise ValueError(
                f"the GPU kernel takes interpret=True or False, got {interpret!r} (InterpretParams simulate a TPU)"
            )
        return gpu.gather_attention_gpu_kernel(
            q, k_slots, v_slots, slot_table, lengths, block_size=block_size, interpret=interpret, scale=scale
        )
    return tpu.gather_attention_kernel(
        q, k_slots, v_slots, slot_table, lengths, block_size=block_size, interpret=interpret, scale=scale
    )


def _kernel_platform(backend: str | None, interpret: bool | pltpu.InterpretParams | None):
    """(whose kernel runs: "gpu" or "tpu", interpret) as `gather_attention` picks them."""
    backend = jax.default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    platform = "gpu" if backend == "gpu" else "tpu"
    if interpret is None:
        interpret = backend == "cpu" or jax.default_backend() != platform
    if platform == "gpu" and not isinstance(interpret, bool):
        raise ValueError(
            f"the GPU kernel takes interpret=True or False, got {interpret!r} (InterpretParams simulate a TPU)"
        )
    return platform, interpret


def slot_pool_attention(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,  # codes i8 | f8e4m3fn[B, K, C, H], scale f16[B, K, C, 1]
    v: QuantizedBlock,  # the same
    slot_table: jax.Array,  # i32[B, K, S]
    lengths: jax.Array,  # i32[B, K]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    use_kernel: bool,
    backend: str | None = None,
    block_size: int | None = None,  # None: the backend's default, as for gather_attention
    interpret: bool | pltpu.InterpretParams | None = None,
    scale: float | None = None,
) -> quantized_reference.SoftmaxPartial:  # o f32[B, K, G, H], m / l f32[B, K, G]
    """Partial softmax state over an int8_sym / fp8 slot pool: the XLA reference or a kernel (codes read as codes)."""
    kw = {"k_fmt": k_fmt, "v_fmt": v_fmt, "scale": scale}
    if not use_kernel:
        return quantized_reference.ref_slot_pool_attention(q, k, v, slot_table, lengths, **kw)
    platform, interpret = _kernel_platform(backend, interpret)
    if block_size is None:
        block_size = kernel_block_size(platform, slot_table.shape[-1])
    slot_table, lengths = _pad_to_blocks(slot_table, lengths, block_size)
    kernel = (
        quantized_gpu.slot_pool_attention_gpu_kernel
        if platform == "gpu"
        else quantized_slot_tpu.slot_pool_attention_kernel
    )
    return kernel(q, k, v, slot_table, lengths, block_size=block_size, interpret=interpret, **kw)


def block_pool_attention(
    q: jax.Array,  # f[B, K, G, H]
    k: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f16[B, K, NB, 1, H]
    v: QuantizedBlock,  # codes u8[B, K, NB, Gt, H*bits/8], scale / zero f16[B, K, NB, Gt, H/gv]
    block_table: jax.Array,  # i32[B, K, T]
    nblocks: jax.Array,  # i32[B, K]
    live: jax.Array,  # bool | int[B, K, NB, Gt]
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    use_kernel: bool,
    backend: str | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
    scale: float | None = None,
) -> quantized_reference.SoftmaxPartial:  # o f32[B, K, G, H], m / l f32[B, K, G]
    """Partial softmax state over a KIVI block pool: the XLA reference or a kernel (codes unpacked in the kernel)."""
    kw = {"k_fmt": k_fmt, "v_fmt": v_fmt, "scale": scale}
    if not use_kernel:
        return quantized_reference.ref_block_pool_attention(q, k, v, block_table, nblocks, live, **kw)
    platform, interpret = _kernel_platform(backend, interpret)
    kernel = (
        quantized_gpu.block_pool_attention_gpu_kernel
        if platform == "gpu"
        else quantized_block_tpu.block_pool_attention_kernel
    )
    return kernel(q, k, v, block_table, nblocks, live, interpret=interpret, **kw)


def per_row_shards(fn: Callable, axes: tuple[str | None, str | None]) -> Callable:
    """`fn` over arrays whose leading dimensions are [B, K] (sequence, KV head), each row independent: on an active
    mesh run per shard (`jax.shard_map` over `axes`, so nothing is gathered); otherwise `fn` itself."""
    if jax.sharding.get_abstract_mesh().empty:
        return fn
    spec = P(*axes)
    return jax.shard_map(fn, in_specs=spec, out_specs=spec, check_vma=False)

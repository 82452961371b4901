"""Pallas kernels for gather + GQA decode attention over a slot-pool KV cache, laid out as JAX's own Pallas ops are.

- ``reference.py``: the contract, input validation, the pure-jnp reference and the shared masked softmax.
- ``tpu.py``: the TPU kernel (Mosaic), with its SMEM / VMEM footprint check.
- ``gpu.py``: the GPU kernel (Triton).
- ``quantized_reference.py``, ``quantized_slot_tpu.py`` / ``quantized_block_tpu.py`` (TPU), ``quantized_gpu.py``: the
  same decode attention over quantized pools (int8 / fp8 slot pools, KIVI block pools), the codes dequantized inside
  the kernels, each returning a partial softmax state that ``merge_partials`` combines across pools.
- ``dispatch.py``: ``gather_attention`` (and ``slot_pool_attention`` / ``block_pool_attention`` for quantized pools),
  the one switch between the reference and the kernel of each backend, and ``per_row_shards``, which runs such a
  per-(sequence, KV head) op per shard on a device mesh.

``tpu.py`` and ``gpu.py`` import only ``reference.py`` (the quantized kernels only ``quantized_reference.py`` and
``quantize.py``; the block-pool TPU one also ``quantized_slot_tpu.py``'s shared Mosaic helpers, the GPU one also
``gpu.py``'s Triton limits): a TPU module never imports a GPU one; only ``dispatch.py`` knows both backends.
"""

from pask_jax.kernels.dispatch import (
    BACKENDS,
    block_pool_attention,
    gather_attention,
    kernel_block_size,
    per_row_shards,
    slot_pool_attention,
)
from pask_jax.kernels.gpu import DEFAULT_GPU_BLOCK_SIZE, gather_attention_gpu_kernel, validate_gpu_inputs
from pask_jax.kernels.quantized_block_tpu import block_pool_attention_kernel
from pask_jax.kernels.quantized_gpu import block_pool_attention_gpu_kernel, slot_pool_attention_gpu_kernel
from pask_jax.kernels.quantized_reference import (
    SoftmaxPartial,
    merge_partials,
    ref_block_pool_attention,
    ref_slot_pool_attention,
)
from pask_jax.kernels.quantized_slot_tpu import slot_pool_attention_kernel
from pask_jax.kernels.reference import masked_softmax, ref_gather_attention, validate_inputs
from pask_jax.kernels.tpu import DEFAULT_TPU_BLOCK_SIZE, gather_attention_kernel, validate_tpu_inputs

__all__ = [
    "BACKENDS",
    "DEFAULT_GPU_BLOCK_SIZE",
    "DEFAULT_TPU_BLOCK_SIZE",
    "SoftmaxPartial",
    "block_pool_attention",
    "block_pool_attention_gpu_kernel",
    "block_pool_attention_kernel",
    "gather_attention",
    "gather_attention_gpu_kernel",
    "gather_attention_kernel",
    "kernel_block_size",
    "masked_softmax",
    "merge_partials",
    "per_row_shards",
    "ref_block_pool_attention",
    "ref_gather_attention",
    "ref_slot_pool_attention",
    "slot_pool_attention",
    "slot_pool_attention_gpu_kernel",
    "slot_pool_attention_kernel",
    "validate_gpu_inputs",
    "validate_inputs",
    "validate_tpu_inputs",
]

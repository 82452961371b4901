"""Pallas kernels for gather + GQA decode attention over a slot-pool KV cache, laid out as JAX's own Pallas ops are.

- ``reference.py``: the contract, input validation, the pure-jnp reference and the shared masked softmax.
- ``tpu.py``: the TPU kernel (Mosaic), with its SMEM / VMEM footprint check.
- ``gpu.py``: the GPU kernel (Triton).
- ``dispatch.py``: ``gather_attention``, the one switch between the reference and the kernel of each backend, and
  ``per_row_shards``, which runs such a per-(sequence, KV head) op per shard on a device mesh.

``tpu.py`` and ``gpu.py`` import only ``reference.py``; only ``dispatch.py`` knows both.
"""

from pask_jax.kernels.dispatch import BACKENDS, gather_attention, kernel_block_size, per_row_shards
from pask_jax.kernels.gpu import DEFAULT_GPU_BLOCK_SIZE, gather_attention_gpu_kernel, validate_gpu_inputs
from pask_jax.kernels.reference import masked_softmax, ref_gather_attention, validate_inputs
from pask_jax.kernels.tpu import DEFAULT_TPU_BLOCK_SIZE, gather_attention_kernel, validate_tpu_inputs

__all__ = [
    "BACKENDS",
    "DEFAULT_GPU_BLOCK_SIZE",
    "DEFAULT_TPU_BLOCK_SIZE",
    "gather_attention",
    "gather_attention_gpu_kernel",
    "gather_attention_kernel",
    "kernel_block_size",
    "masked_softmax",
    "per_row_shards",
    "ref_gather_attention",
    "validate_gpu_inputs",
    "validate_inputs",
    "validate_tpu_inputs",
]

"""Pallas kernels (TPU / Mosaic, GPU / Triton) with pure-jnp references beside them."""

from pask_jax.kernels.gather_attention import (
    DEFAULT_BLOCK_SIZE,
    gather_attention,
    gather_attention_kernel,
    ref_gather_attention,
    validate_inputs,
)
from pask_jax.kernels.gather_attention_gpu import (
    DEFAULT_GPU_BLOCK_SIZE,
    gather_attention_gpu_kernel,
    validate_gpu_inputs,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GPU_BLOCK_SIZE",
    "gather_attention",
    "gather_attention_gpu_kernel",
    "gather_attention_kernel",
    "ref_gather_attention",
    "validate_gpu_inputs",
    "validate_inputs",
]

"""Pallas kernels (TPU / Mosaic) with pure-jnp references beside them."""

from pask_jax.kernels.gather_attention import (
    DEFAULT_BLOCK_SIZE,
    gather_attention,
    gather_attention_kernel,
    ref_gather_attention,
    validate_inputs,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "gather_attention",
    "gather_attention_kernel",
    "ref_gather_attention",
    "validate_inputs",
]

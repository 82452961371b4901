"""Decode attention over quantized KV pools: the GPU (Triton) kernels vs the pure-jnp references.

Interpreted on CPU (``interpret=True``): the indexing and the math, not the Triton lowering; set
``PASK_TRITON_COMPILED=1`` on a GPU machine to run the same cases compiled. Cases and poisoning as in
``test_kernels_quantized.py`` (the TPU kernels), with Triton's shapes (block_size 16).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import pytest

# this folder is on sys.path (pytest's prepend import mode)
from test_kernels_quantized import B, K, S, assert_partial_close, block_case, slot_case

from pask_jax.kernels.quantize import FP8, INT8, KVFormat, QuantizedBlock, quantize
from pask_jax.kernels.quantized_gpu import (
    block_pool_attention_gpu_kernel,
    slot_pool_attention_gpu_kernel,
    validate_gpu_block_pool,
    validate_gpu_slot_pool,
)
from pask_jax.kernels.quantized_reference import merge_partials, ref_block_pool_attention, ref_slot_pool_attention

INTERPRET = os.environ.get("PASK_TRITON_COMPILED") != "1"


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8", "fp8"])
def test_slot_pool_gpu_kernel_matches_reference(fmt):
    q, clean, poisoned, table, lengths = slot_case(1, fmt)
    out = slot_pool_attention_gpu_kernel(
        q, *poisoned, table, lengths, k_fmt=fmt, v_fmt=fmt, block_size=16, interpret=INTERPRET
    )
    assert_partial_close(out, ref_slot_pool_attention(q, *clean, table, lengths, k_fmt=fmt, v_fmt=fmt))


@pytest.mark.parametrize("k_bits,v_bits,gt,gv", [(2, 2, 16, 16), (4, 4, 32, 16), (2, 4, 16, 32)])
def test_block_pool_gpu_kernel_matches_reference(k_bits, v_bits, gt, gv):
    k_fmt, v_fmt = KVFormat(k_bits, "int", "channel", gt), KVFormat(v_bits, "int", "token", gv)
    q, clean, poisoned, args = block_case(10 * k_bits + gt, k_fmt, v_fmt)
    out = block_pool_attention_gpu_kernel(q, *poisoned, *args, k_fmt=k_fmt, v_fmt=v_fmt, interpret=INTERPRET)
    assert_partial_close(out, ref_block_pool_attention(q, *clean, *args, k_fmt=k_fmt, v_fmt=v_fmt))


def test_gpu_parts_merge_like_reference_parts():
    k_fmt, v_fmt = KVFormat(2, "int", "channel", 16), KVFormat(2, "int", "token", 16)
    q, clean_slot, poisoned_slot, slot_table, lengths = slot_case(5, INT8)
    _, clean_blk, poisoned_blk, block_args = block_case(6, k_fmt, v_fmt)
    parts = [
        slot_pool_attention_gpu_kernel(
            q, *poisoned_slot, slot_table, lengths, k_fmt=INT8, v_fmt=INT8, block_size=16, interpret=INTERPRET
        ),
        block_pool_attention_gpu_kernel(q, *poisoned_blk, *block_args, k_fmt=k_fmt, v_fmt=v_fmt, interpret=INTERPRET),
    ]
    want = merge_partials(
        [
            ref_slot_pool_attention(q, *clean_slot, slot_table, lengths, k_fmt=INT8, v_fmt=INT8),
            ref_block_pool_attention(q, *clean_blk, *block_args, k_fmt=k_fmt, v_fmt=v_fmt),
        ]
    )
    got = merge_partials(parts)
    assert float(jnp.max(jnp.abs(got - want))) < 2e-5


def test_gpu_validation_errors():
    q, (k, v), _, table, lengths = slot_case(0, INT8)
    kw = {"k_fmt": INT8, "v_fmt": INT8}
    validate_gpu_slot_pool(q, k, v, table, lengths, block_size=16, **kw)
    with pytest.raises(ValueError, match="block_size a power of two, got 12"):
        validate_gpu_slot_pool(q, k, v, table, lengths, block_size=12, **kw)
    with pytest.raises(ValueError, match=r"block_size >= 16 \(tl.dot\), got 8"):
        validate_gpu_slot_pool(q, k, v, table, lengths, block_size=8, **kw)
    with pytest.raises(ValueError, match=f"S={S} must be a multiple of block_size=32"):
        validate_gpu_slot_pool(q, k, v, table, lengths, block_size=32, **kw)

    k_fmt, v_fmt = KVFormat(2, "int", "channel", 16), KVFormat(2, "int", "token", 16)
    q, (k, v), _, (table, nblocks, live) = block_case(0, k_fmt, v_fmt)
    validate_gpu_block_pool(q, k, v, table, nblocks, live, k_fmt=k_fmt, v_fmt=v_fmt)
    k_small = QuantizedBlock(k.codes[:, :, :, :8], k.scale, k.zero)  # Gt = 8
    v_small = QuantizedBlock(v.codes[:, :, :, :8], v.scale[:, :, :, :8], v.zero[:, :, :, :8])
    small = (table, nblocks, live[..., :8])
    with pytest.raises(ValueError, match=r"block tokens Gt >= 16 \(tl.dot\), got 8"):
        validate_gpu_block_pool(q, k_small, v_small, *small, k_fmt=KVFormat(2, "int", "channel", 8), v_fmt=v_fmt)
    with pytest.raises(ValueError, match="head dim H a power of two, got 48"):
        k48, v48 = (quantize(jnp.zeros((B, K, 4, 16, 48)), f) for f in (k_fmt, v_fmt))
        validate_gpu_block_pool(q[..., :48], k48, v48, table, nblocks, live, k_fmt=k_fmt, v_fmt=v_fmt)


def test_dispatch_runs_the_gpu_block_kernel():
    from pask_jax.kernels import block_pool_attention

    k_fmt, v_fmt = KVFormat(2, "int", "channel", 16), KVFormat(2, "int", "token", 16)
    q, clean, poisoned, args = block_case(8, k_fmt, v_fmt)
    got = block_pool_attention(q, *poisoned, *args, k_fmt=k_fmt, v_fmt=v_fmt, use_kernel=True, backend="gpu")
    assert_partial_close(got, ref_block_pool_attention(q, *clean, *args, k_fmt=k_fmt, v_fmt=v_fmt))

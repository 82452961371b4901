"""Gather + GQA decode attention, GPU (Triton) kernel vs the pure-jnp reference.

On CPU the kernel runs with ``interpret=True``. On a GPU, ``PASK_GPU_KERNEL_COMPILED=1`` runs it compiled (Triton)::

    PASK_GPU_KERNEL_COMPILED=1 python -m pytest tests/kernels/test_kernels_gpu.py
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

# this folder is on sys.path (pytest's prepend import mode)
from test_kernels_tpu import TOL, assert_close, make_case, poison_unkept_slots

from pask_jax.kernels.gpu import gather_attention_gpu_kernel, padded_group_size, validate_gpu_inputs
from pask_jax.kernels.reference import ref_gather_attention

COMPILED = os.environ.get("PASK_GPU_KERNEL_COMPILED") == "1"


def run_kernel(*args, **kwargs):
    return gather_attention_gpu_kernel(*args, interpret=not COMPILED, **kwargs)


def reference(*args, **kwargs):
    with jax.default_matmul_precision("highest"):  # XLA:GPU would use TF32 for f32 einsums
        return ref_gather_attention(*args, **kwargs)


def test_mode_matches_backend():
    """PASK_GPU_KERNEL_COMPILED=1 must mean a GPU run: never let a CPU fallback pass as a GPU check."""
    assert not COMPILED or jax.default_backend() == "gpu", f"compiled mode on backend {jax.default_backend()!r}"


# (B, K, G, H, C, S, block_size, num_splits, dtype): G 1/2/7/16/20 (padded to 16 or 32), H 16..128, C 16..64 (also
# not a power of two), 1-4 blocks per split, 1/2/4 splits, f32 and bf16.
CASES = [
    (1, 2, 1, 16, 16, 16, 16, 1, jnp.float32),
    (3, 2, 2, 64, 48, 32, 16, 1, jnp.float32),
    (2, 2, 7, 64, 64, 64, 16, 2, jnp.float32),
    (1, 3, 16, 32, 40, 32, 16, 2, jnp.float32),
    (2, 1, 20, 128, 64, 64, 32, 1, jnp.float32),
    (3, 2, 1, 64, 48, 32, 16, 1, jnp.bfloat16),
    (1, 3, 7, 128, 64, 64, 32, 2, jnp.bfloat16),
    (2, 2, 2, 32, 64, 64, 16, 4, jnp.bfloat16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case):
    b, k, g, h, c, s, block_size, num_splits, dtype = CASES[case]
    args = make_case(case, b, k, g, h, c, s, block_size, dtype)  # permuted tables, lengths incl. 0 and S
    out = run_kernel(*args, block_size=block_size, num_splits=num_splits)
    assert out.shape == (b, k, g, h)
    assert_close(out, reference(*args), dtype)
    assert not np.asarray(out[0, 0], np.float32).any()  # lengths[0, 0] == 0 -> zeros


@pytest.mark.parametrize("num_splits", [1, 4])
def test_zero_lengths_give_zeros_and_unkept_nan_slots_are_ignored(num_splits):
    q, k_slots, v_slots, table, lengths = make_case(11, 2, 2, 2, 32, 64, 64, 16)
    zeros = run_kernel(q, k_slots, v_slots, table, jnp.zeros_like(lengths), block_size=16, num_splits=num_splits)
    assert not np.isnan(np.asarray(zeros)).any() and not np.asarray(zeros).any()
    # poison every slot no table entry keeps (slot 0, which stands in for masked entries, too): no change
    poisoned_k, poisoned_v = poison_unkept_slots(k_slots, v_slots, table, lengths)
    out = run_kernel(
        q,
        poisoned_k,
        poisoned_v,
        table,
        lengths,
        block_size=16,
        num_splits=num_splits,
    )
    assert_close(out, reference(q, k_slots, v_slots, table, lengths), jnp.float32)


def test_scale_and_jit():
    args = make_case(5, 1, 2, 7, 64, 48, 32, 16)
    scaled = jax.jit(lambda *a: run_kernel(*a, block_size=16, num_splits=2, scale=0.5))(*args)
    assert_close(scaled, reference(*args, scale=0.5), jnp.float32)
    default = np.asarray(reference(*args))  # 1/sqrt(64) != 0.5: the comparison above can tell them apart
    assert np.abs(np.asarray(scaled) - default).max() > 100 * TOL[jnp.float32]


def test_validation_errors():
    q, k_slots, v_slots, table, lengths = make_case(0, 2, 2, 2, 64, 48, 48, 16)
    with pytest.raises(ValueError, match="block_size a power of two >= 16, got 24"):
        validate_gpu_inputs(q, k_slots, v_slots, table, lengths, block_size=24)
    with pytest.raises(ValueError, match="block_size a power of two >= 16, got 8"):
        run_kernel(q, k_slots, v_slots, table[..., :32], lengths, block_size=8)
    for h in (48, 8):
        with pytest.raises(ValueError, match=f"head dim H a power of two >= 16, got H={h}"):
            run_kernel(q[..., :h], k_slots[..., :h], v_slots[..., :h], table[..., :32], lengths, block_size=16)
    with pytest.raises(ValueError, match="S=32 must split into num_splits=4 parts of whole blocks of block_size=16"):
        run_kernel(q, k_slots, v_slots, table[..., :32], lengths, block_size=16, num_splits=4)
    with pytest.raises(ValueError, match="num_splits=0"):
        run_kernel(q, k_slots, v_slots, table[..., :32], lengths, block_size=16, num_splits=0)
    # validate_inputs' own checks come first
    with pytest.raises(ValueError, match="S=48 must be a positive multiple of block_size=32"):
        run_kernel(q, k_slots, v_slots, table, lengths, block_size=32)
    with pytest.raises(ValueError, match="one dtype, float32 or bfloat16; got q float16, k_slots float32"):
        run_kernel(q.astype(jnp.float16), k_slots, v_slots, table, lengths, block_size=16)
    with pytest.raises(ValueError, match=r"lengths must be \[B, K\] = \[2, 2\], got shape \(2,\)"):
        run_kernel(q, k_slots, v_slots, table, lengths[:, 0], block_size=16)
    assert [padded_group_size(g) for g in (1, 7, 16, 17, 32)] == [16, 16, 16, 32, 32]
    validate_gpu_inputs(q, k_slots, v_slots, table, lengths, block_size=16, num_splits=3)


@pytest.mark.parametrize(
    "g,h,c,s,block_size,num_splits,dtype",
    [(7, 64, 100, 128, 64, 1, jnp.float32), (32, 128, 1024, 1024, 128, 4, jnp.bfloat16)],
)
def test_triton_lowering(g, h, c, s, block_size, num_splits, dtype):
    """Lower for CUDA without a GPU: runs the Pallas -> Triton IR lowering (power-of-two sizes, dots, the gather)."""
    shapes = [((2, 2, g, h), dtype), ((2, 2, c, h), dtype), ((2, 2, c, h), dtype), ((2, 2, s), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, d) for shape, d in [*shapes, ((2, 2), jnp.int32)]]
    fn = jax.jit(lambda *a: gather_attention_gpu_kernel(*a, block_size=block_size, num_splits=num_splits))
    skip_check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # no stability promise: not needed
    exported = export.export(fn, platforms=["cuda"], disabled_checks=[skip_check])(*args)
    assert "xla.gpu.triton" in exported.mlir_module()
    assert exported.out_avals[0].shape == (2, 2, g, h)

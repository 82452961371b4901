"""The dispatcher: the XLA reference or each backend's kernel, block sizes, table padding; the engine uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

# this folder is on sys.path (pytest's prepend import mode)
from test_kernels_tpu import TOL, assert_close, make_case

import pask_jax.attention
from pask_jax.kernels import gather_attention, gpu, kernel_block_size, ref_gather_attention, tpu
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig

KERNELS = {"tpu": (tpu, "gather_attention_kernel"), "gpu": (gpu, "gather_attention_gpu_kernel")}


def spy_kernels(monkeypatch, passthrough: bool = True) -> list[tuple[str, dict]]:
    """Replace both kernels by recorders of (kernel, kwargs + the table length it got); they call the real kernel."""
    calls = []
    for name, (module, attr) in KERNELS.items():
        real = getattr(module, attr)

        def spy(q, k_slots, v_slots, slot_table, lengths, _name=name, _real=real, **kwargs):
            calls.append((_name, kwargs | {"table_len": slot_table.shape[-1]}))
            return _real(q, k_slots, v_slots, slot_table, lengths, **kwargs) if passthrough else q

        monkeypatch.setattr(module, attr, spy)
    return calls


# S=20 fits neither kernel's block: TPU block 24, GPU block 32, the table padded to one block
@pytest.mark.parametrize("backend,kernel,block", [("tpu", "tpu", 24), ("gpu", "gpu", 32), ("cpu", "tpu", 24)])
def test_backend_picks_its_kernel(monkeypatch, backend, kernel, block):
    calls = spy_kernels(monkeypatch)
    q, k_slots, v_slots, table, lengths = make_case(3, 2, 2, 2, 64, 48, 20, 16)
    lengths = lengths.at[1, 1].set(27)  # past S: counts as S, never as the padding
    out = gather_attention(q, k_slots, v_slots, table, lengths, use_kernel=True, backend=backend)
    assert calls == [(kernel, {"block_size": block, "interpret": True, "scale": None, "table_len": block})]
    assert_close(out, ref_gather_attention(q, k_slots, v_slots, table, lengths), jnp.float32)


def test_reference_path_calls_no_kernel(monkeypatch):
    calls = spy_kernels(monkeypatch)
    args = make_case(5, 1, 2, 7, 64, 48, 32, 16)
    out = jax.jit(lambda *a: gather_attention(*a, use_kernel=False, backend="tpu", block_size=6))(*args)
    assert calls == []  # block_size is ignored by the reference
    np.testing.assert_array_equal(out, ref_gather_attention(*args))


@pytest.mark.parametrize(
    "platform,backend,kernel,interpret",
    [
        ("tpu", None, "tpu", False),  # each kernel compiled on its own platform
        ("gpu", None, "gpu", False),
        ("gpu", "tpu", "tpu", True),  # interpreted elsewhere
        ("tpu", "gpu", "gpu", True),
        ("tpu", "cpu", "tpu", True),  # no CPU kernel: the TPU kernel, always interpreted
        ("cpu", None, "tpu", True),
    ],
)
def test_compiled_only_on_the_kernels_own_platform(monkeypatch, platform, backend, kernel, interpret):
    calls = spy_kernels(monkeypatch, passthrough=False)
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    args = make_case(3, 1, 2, 2, 64, 16, 16, 16)
    assert gather_attention(*args, use_kernel=True, backend=backend, scale=0.25) is args[0]
    block = 16  # S=16: the GPU minimum, and the TPU block for 16 slots
    assert calls == [(kernel, {"block_size": block, "interpret": interpret, "scale": 0.25, "table_len": 16})]


def test_explicit_block_size_and_interpret_are_passed_on(monkeypatch):
    calls = spy_kernels(monkeypatch)
    args = make_case(5, 1, 2, 7, 64, 48, 32, 16)
    params = pltpu.InterpretParams()
    out = gather_attention(*args, use_kernel=True, backend="tpu", block_size=12, interpret=params, scale=0.5)
    assert calls == [("tpu", {"block_size": 12, "interpret": params, "scale": 0.5, "table_len": 36})]
    assert_close(out, ref_gather_attention(*args, scale=0.5), jnp.float32)
    default = np.asarray(ref_gather_attention(*args))  # 1/sqrt(64) != 0.5: the scale reached the kernel
    assert np.abs(np.asarray(out) - default).max() > 100 * TOL[jnp.float32]
    jitted = jax.jit(lambda *a: gather_attention(*a, use_kernel=True, backend="gpu", block_size=16))(*args)
    assert calls[-1] == ("gpu", {"block_size": 16, "interpret": True, "scale": None, "table_len": 32})
    assert_close(jitted, ref_gather_attention(*args), jnp.float32)


def test_default_block_sizes():
    tpu_blocks = [kernel_block_size("tpu", s) for s in (1, 8, 17, 100, 128, 1025)]
    assert tpu_blocks == [8, 8, 24, 104, 128, 128]  # whole sublane tiles, at most DEFAULT_TPU_BLOCK_SIZE
    gpu_blocks = [kernel_block_size("gpu", s) for s in (1, 16, 17, 33, 64, 1025)]
    assert gpu_blocks == [16, 16, 32, 64, 64, 64]  # powers of two >= 16, at most DEFAULT_GPU_BLOCK_SIZE


def test_bad_arguments_are_named():
    q, k_slots, v_slots, table, lengths = make_case(0, 2, 2, 2, 64, 48, 48, 16)
    with pytest.raises(ValueError, match=r"backend must be one of \('cpu', 'gpu', 'tpu'\) or None, got 'cuda'"):
        gather_attention(q, k_slots, v_slots, table, lengths, use_kernel=True, backend="cuda")
    with pytest.raises(ValueError, match="GPU kernel takes interpret=True or False"):
        gather_attention(
            q, k_slots, v_slots, table, lengths, use_kernel=True, backend="gpu", interpret=pltpu.InterpretParams()
        )
    with pytest.raises(ValueError, match="block_size a power of two >= 16, got 24"):
        gather_attention(q, k_slots, v_slots, table, lengths, use_kernel=True, backend="gpu", block_size=24)
    for use_kernel in (False, True):  # shapes are checked on every path, before a kernel is chosen
        with pytest.raises(ValueError, match=r"lengths must be \[B, K\] = \[2, 2\], got shape \(2,\)"):
            gather_attention(q, k_slots, v_slots, table, lengths[:, 0], use_kernel=use_kernel)


PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 120]]


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(ModelConfig.tiny("qwen3", vocab_size=160), rngs=nnx.Rngs(5))  # its own shapes: a fresh trace


# different layer groupings: each case traces its own decode step (a cached one would never call the spies)
@pytest.mark.parametrize("backend,num_groups", [("cpu", 1), ("gpu", 2)])
def test_engine_use_kernel_goes_through_the_dispatcher(monkeypatch, model, backend, num_groups):
    """Greedy tokens with the kernel (the TPU one on CPU; the GPU one forced) equal the XLA path's."""
    reference = Engine(model, length_buckets=(16,)).generate(PROMPTS, SamplingConfig(max_new_tokens=6))
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return gather_attention(*args, **kwargs, backend=backend)

    monkeypatch.setattr(pask_jax.attention, "gather_attention", spy)
    kernel_calls = spy_kernels(monkeypatch)
    engine = Engine(model, num_groups=num_groups, use_kernel=True, length_buckets=(16,))
    out = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=6))
    assert [g.tokens for g in out] == [g.tokens for g in reference]
    assert calls == [{"use_kernel": True}] * model.config.num_layers  # one decode step traced, one call per layer
    assert {name for name, _ in kernel_calls} == {"gpu" if backend == "gpu" else "tpu"}

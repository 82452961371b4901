"""The KV quantizers against an independent numpy reference: codes, scales, packing, error bounds, bytes, jit."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax.kernels.quantize import (
    FP8,
    FULL,
    INT4_TOKEN,
    INT8,
    KIVI2_KEY,
    KIVI2_VALUE,
    KIVI4_KEY,
    KIVI4_VALUE,
    PRESETS,
    KVFormat,
    QuantizedBlock,
    bytes_per_token,
    dequantize,
    pack,
    quantize,
    unpack,
)

F32, F16 = np.float32, np.float16
GRID = list(itertools.product((2, 4, 8), ("token", "channel"), (16, 32)))


def make_kv(seed: int = 0, shape: tuple[int, ...] = (2, 3, 64, 64)) -> np.ndarray:  # f32[B, K, T, H]
    """Gaussian K/V with a few outlier channels (x10), as keys have."""
    x = np.random.default_rng(seed).normal(size=shape).astype(F32)
    x[..., [3, 17, 40]] *= 10
    return x


# --- numpy reference (independent of the jnp code) ------------------------------------------------------------------


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:  # u8[..., n] -> u8[..., ceil(n*bits/8)]
    per = 8 // bits
    n = codes.shape[-1]
    out = np.zeros((*codes.shape[:-1], -(-n // per)), np.uint8)
    for i in range(n):
        out[..., i // per] |= (codes[..., i].astype(np.uint8) << np.uint8(bits * (i % per))).astype(np.uint8)
    return out


def np_quantize_int(x: np.ndarray, bits: int, axis: str, group: int):
    """codes u8[..., T, H] (unpacked), scale f16, zero f16 (shaped as the module's), values f32[..., T, H]."""
    *lead, t, h = x.shape
    xg = x.reshape(*lead, t, h // group, group) if axis == "token" else x.reshape(*lead, t // group, group, h)
    red = -1 if axis == "token" else -2
    lo, hi = xg.min(red, keepdims=True), xg.max(red, keepdims=True)
    levels = 2**bits - 1
    scale = ((hi - lo) * F32(1 / levels)).astype(F16)  # the reciprocal's product, as the module (and XLA) computes
    zero = lo.astype(F16)
    s32, z32 = scale.astype(F32), zero.astype(F32)
    codes = np.clip(np.rint((xg - z32) / np.where(s32 == 0, F32(1), s32)), 0, levels).astype(np.uint8)
    values = codes.astype(F32) * s32 + z32
    return codes.reshape(x.shape), scale.squeeze(red), zero.squeeze(red), values.reshape(x.shape)


def np_round_e4m3(y: np.ndarray) -> np.ndarray:
    """Nearest float8_e4m3fn value (ties to even) of y f32 with |y| <= 448: 3 mantissa bits, exponents >= -6."""
    a = np.abs(y).astype(np.float64)
    exp = np.maximum(np.frexp(a)[1] - 1, -6)  # floor(log2 |y|); subnormals share 2^-6's spacing
    step = np.exp2(exp - 3.0)
    return (np.sign(y) * np.rint(a / step) * step).astype(F32)


def np_quantize_sym(x: np.ndarray, kind: str):
    """codes (int8 or e4m3 values as f32)[..., T, H], scale f16[..., T, 1], values f32[..., T, H]."""
    top = 127 if kind == "int8_sym" else 448
    scale = (np.abs(x).max(-1, keepdims=True) * F32(1 / top)).astype(F16)
    s32 = scale.astype(F32)
    y = np.clip(x / np.where(s32 == 0, F32(1), s32), -top, top)
    codes = np.rint(y) if kind == "int8_sym" else np_round_e4m3(y)
    return codes, scale, codes.astype(F32) * s32


# --- tests ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [64, 13])
def test_pack_unpack_exact_inverse(bits: int, n: int) -> None:
    codes = np.random.default_rng(n).integers(0, 2**bits, size=(3, 5, n), dtype=np.uint8)
    packed = pack(jnp.asarray(codes), bits)  # u8[3, 5, ceil(n*bits/8)]
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, -(-n * bits // 8))
    np.testing.assert_array_equal(np.asarray(packed), np_pack(codes, bits))
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits, n)), codes)


@pytest.mark.parametrize("bits,axis,group", GRID)
def test_int_matches_numpy_reference(bits: int, axis: str, group: int) -> None:
    fmt = KVFormat(bits, "int", axis, group)
    x = make_kv(bits + group)
    block = quantize(jnp.asarray(x), fmt)
    codes, scale, zero, values = np_quantize_int(x, bits, axis, group)
    groups = (2, 3, 64, 64 // group) if axis == "token" else (2, 3, 64 // group, 64)
    assert block.codes.shape == (2, 3, 64, 64 * bits // 8) and block.codes.dtype == jnp.uint8
    assert block.scale.shape == block.zero.shape == groups and block.scale.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(block.codes), np_pack(codes, bits))
    np.testing.assert_array_equal(np.asarray(block.scale), scale)
    np.testing.assert_array_equal(np.asarray(block.zero), zero)
    np.testing.assert_allclose(np.asarray(dequantize(block, fmt)), values, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits,axis,group", GRID)
def test_int_error_within_half_a_step(bits: int, axis: str, group: int) -> None:
    fmt = KVFormat(bits, "int", axis, group)
    x = make_kv(1)
    block = quantize(jnp.asarray(x), fmt)
    err = np.abs(x - np.asarray(dequantize(block, fmt)))  # f32[2, 3, T, H]
    scale, zero = np.asarray(block.scale, F32), np.asarray(block.zero, F32)
    if axis == "token":  # per element: f32[..., T, H/g] -> f32[..., T, H]
        scale, zero = np.repeat(scale, group, -1), np.repeat(zero, group, -1)
    else:  # f32[..., T/G, H] -> f32[..., T, H]
        scale, zero = np.repeat(scale, group, -2), np.repeat(zero, group, -2)
    # half a step, plus the float16 rounding of scale and zero (relative 2^-11 each, over the group's range)
    slack = 2.0**-10 * (np.abs(zero) + (2**bits - 1) * scale) + 1e-6 * np.abs(x)
    assert np.all(err <= scale / 2 + slack)


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8_sym", "fp8"])
def test_symmetric_formats_match_reference_and_bound(fmt: KVFormat) -> None:
    x = make_kv(2)
    block = quantize(jnp.asarray(x), fmt)
    codes, scale, values = np_quantize_sym(x, fmt.kind)
    assert block.zero is None and block.scale.shape == (2, 3, 64, 1) and block.scale.dtype == jnp.float16
    assert block.codes.dtype == (jnp.int8 if fmt.kind == "int8_sym" else jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(block.codes).astype(F32), codes)
    np.testing.assert_array_equal(np.asarray(block.scale), scale)
    deq = np.asarray(dequantize(block, fmt))
    np.testing.assert_allclose(deq, values, rtol=1e-6, atol=1e-6)
    err, absmax = np.abs(x - deq), np.abs(x).max(-1, keepdims=True)
    if fmt.kind == "int8_sym":  # half a step of absmax / 127 (+ its float16 rounding)
        assert np.all(err <= absmax / 254 * (1 + 2.0**-9) + 1e-6 * absmax)
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormal spacing 2^-9 of the scale
        s = np.asarray(block.scale, F32)
        assert np.all(err <= 2.0**-4 * np.abs(x) * (1 + 2.0**-9) + 2.0**-10 * s + 1e-6 * absmax)
    relative = np.linalg.norm(x - deq) / np.linalg.norm(x)
    assert relative < (0.02 if fmt.kind == "int8_sym" else 0.05)  # the x10 outlier channels set the scale


@pytest.mark.parametrize("bits,axis,group", GRID)
def test_constant_groups_are_exact(bits: int, axis: str, group: int) -> None:
    fmt = KVFormat(bits, "int", axis, group)
    values = np.array([0.5, -3.25, 0.0, 1024.0, 7.0, -0.125], F32)  # float16 numbers
    rng = np.random.default_rng(bits)
    if axis == "token":  # each token: one constant per half of head_dim (so per 16 or 32 channels)
        x = np.repeat(rng.choice(values, size=(2, 64, 2)), 32, -1)
    else:  # each channel constant over the tokens
        x = np.broadcast_to(rng.choice(values, size=(2, 1, 64)), (2, 64, 64))
    block = quantize(jnp.asarray(x), fmt)
    deq = np.asarray(dequantize(block, fmt))
    assert not np.isnan(deq).any() and np.all(np.asarray(block.scale) == 0)
    np.testing.assert_array_equal(deq, x)


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8_sym", "fp8"])
def test_zero_tokens_give_zeros_not_nan(fmt: KVFormat) -> None:
    x = make_kv(3, (2, 8, 64))
    x[:, ::2] = 0  # every other token all zero: scale 0
    deq = np.asarray(dequantize(quantize(jnp.asarray(x), fmt), fmt))
    assert not np.isnan(deq).any()
    np.testing.assert_array_equal(deq[:, ::2], 0)


def test_bytes_per_token_head_dim_64() -> None:
    expected = {
        KIVI2_KEY: 24.0,  # 16 code bytes + 64 channels * (scale + zero) * 2 bytes / 32 tokens
        KIVI2_VALUE: 24.0,  # 16 code bytes + 2 groups * (scale + zero) * 2 bytes
        KIVI4_KEY: 40.0,  # 32 + 8
        KIVI4_VALUE: 40.0,  # 32 + 8
        INT4_TOKEN: 40.0,  # 32 + 8
        KVFormat(2, "int", "token", 16): 32.0,  # 16 + 4 groups * 4
        KVFormat(8, "int", "channel", 16): 80.0,  # 64 + 64 * 4 / 16
        INT8: 66.0,  # 64 + one f16 scale
        FP8: 66.0,
        FULL: 128.0,  # bf16
    }
    assert {fmt: bytes_per_token(fmt, 64) for fmt in expected} == expected


@pytest.mark.parametrize("bits,axis,group", [(2, "channel", 32), (4, "token", 16), (8, "token", 32)])
def test_bytes_per_token_matches_the_arrays(bits: int, axis: str, group: int) -> None:
    fmt = KVFormat(bits, "int", axis, group)
    block = quantize(jnp.zeros((64, 64)), fmt)  # 64 tokens
    total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(block))
    assert total / 64 == bytes_per_token(fmt, 64)


@pytest.mark.parametrize("fmt", [KIVI2_KEY, KIVI2_VALUE, INT4_TOKEN, INT8, FP8, FULL], ids=str)
def test_jit_matches_eager(fmt: KVFormat) -> None:
    x = jnp.asarray(make_kv(4))
    jq = jax.jit(quantize, static_argnums=1)
    jdq = jax.jit(dequantize, static_argnums=1)
    block, eager = jq(x, fmt), quantize(x, fmt)
    assert isinstance(block, QuantizedBlock)
    for a, b in zip(jax.tree.leaves(block), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_equal(np.asarray(a).astype(F32), np.asarray(b).astype(F32))
    np.testing.assert_array_equal(np.asarray(jdq(block, fmt)), np.asarray(dequantize(eager, fmt)))


def test_full_keeps_x() -> None:
    x = jnp.asarray(make_kv(5))
    block = quantize(x, FULL)
    assert block.scale is None and block.zero is None
    np.testing.assert_array_equal(np.asarray(dequantize(block, FULL)), np.asarray(x))


def test_format_validation_and_normalization() -> None:
    assert KVFormat(8, "int8_sym", "channel", 16) == INT8 and hash(KVFormat(8, "fp8")) == hash(FP8)
    assert PRESETS["kivi2"] == (KIVI2_KEY, KIVI2_VALUE) and KVFormat() == FULL
    for kwargs in (dict(bits=3), dict(bits=4, kind="fp8"), dict(kind="nf4"), dict(axis="head"), dict(bits=4, group=0)):
        with pytest.raises(ValueError):
            KVFormat(**kwargs)
    with pytest.raises(ValueError, match="does not divide head_dim"):
        quantize(jnp.zeros((4, 48)), KVFormat(4, "int", "token", 32))
    with pytest.raises(ValueError, match="does not divide the token count"):
        quantize(jnp.zeros((40, 64)), KIVI2_KEY)

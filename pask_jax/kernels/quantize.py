"""Quantizers for a compressed KV cache: formats, bit packing, quantize / dequantize and byte accounting.

A `KVFormat` says how a slot pool stores its keys or its values (one format each); `quantize` turns a block of
tokens ``f[..., T, H]`` (T tokens of one KV head, H = head_dim) into a `QuantizedBlock`, `dequantize` gives float32
back, and `bytes_per_token` is the exact storage one token of one KV head costs. Formats (``kind``):

- ``"int"``, ``bits`` in {2, 4, 8}: asymmetric integer codes per group, ``scale = (max - min) / (2^bits - 1)``,
  ``zero = min``, ``code = round((x - zero) / scale)`` clipped to [0, 2^bits - 1], ``x_hat = code * scale + zero``
  (KIVI, HQQ, vLLM's int4_per_token). A group runs along ``axis``:

  - ``"token"``: one token's ``group`` consecutive channels of head_dim (``group`` divides H): KIVI's values;
  - ``"channel"``: one channel over ``group`` consecutive tokens (slots), T a multiple of ``group``: KIVI's keys.

  Keys have a few outlier channels, far larger than the rest and stable over tokens, so a per-token group spends its
  range on them and crushes the other channels; a per-channel group gives each outlier its own scale. Values have no
  such channels and their error is mixed per token by attention, so per-token groups suit them (KIVI, arXiv
  2402.02750, Sec. 3).
- ``"int8_sym"``: symmetric int8 codes per token and KV head, ``scale = absmax / 127``, ``code = round(x / scale)``
  in [-127, 127], no zero (MaxText, jax-llm-examples, vLLM's int8_per_token_head).
- ``"fp8"``: float8_e4m3fn codes ``x / scale`` per token and KV head, ``scale = absmax / 448`` (e4m3's largest
  finite value).
- ``bits=16``: full precision, stored as it comes and counted as bf16 (2 bytes an element).

Storage. Codes of b < 8 bits are packed 8 / b to a byte along the last axis, the first code in the lowest bits;
8-bit ``"int"`` codes take a uint8 each, ``"int8_sym"`` an int8, ``"fp8"`` a float8_e4m3fn. Scales and zeros are
stored as **float16** (what KIVI and HQQ store): half the overhead of float32 for a relative rounding of 2^-11, which
is why fp8's scale is float16 too. Codes are computed against the float16-rounded scale and zero, so dequantization
(in float32) uses exactly the numbers the codes were fitted to. A range is divided by its level count as a product
with the float32 reciprocal (what XLA makes of a division by a constant under jit), so the scale is the same eager or
jitted and a numpy reference can reproduce it bit for bit. A constant group (scale 0) gets code 0 and is restored
exactly when its value is a float16; float16 overflows above 65504, far beyond KV activations.

Everything is pure ``jax.numpy`` with static shapes, jit-compatible (`KVFormat` is hashable: pass it as static).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Kind = Literal["int", "int8_sym", "fp8"]
Axis = Literal["token", "channel"]
SCALE_DTYPE = jnp.float16  # scales and zeros, as stored
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How a pool stores keys (or values). ``bits=16`` is full precision; ``"int8_sym"`` and ``"fp8"`` are 8 bits.

    ``axis`` / ``group`` apply to ``"int"`` only (see the module docstring); the per-token-and-head kinds and full
    precision normalize them to ``("token", 0)``, 0 meaning the whole head_dim, so equal formats compare equal.
    """

    bits: int = 16
    kind: Kind = "int"
    axis: Axis = "token"
    group: int = 32

    def __post_init__(self) -> None:
        if self.kind not in ("int", "int8_sym", "fp8"):
            raise ValueError(f"kind must be 'int', 'int8_sym' or 'fp8', got {self.kind!r}")
        if self.axis not in ("token", "channel"):
            raise ValueError(f"axis must be 'token' or 'channel', got {self.axis!r}")
        if self.bits not in (2, 4, 8, 16):
            raise ValueError(f"bits must be 2, 4, 8 or 16, got {self.bits}")
        if self.kind != "int" and self.bits != 8:
            raise ValueError(f"{self.kind} codes have 8 bits, got bits={self.bits}")
        if self.kind != "int" or self.full:
            object.__setattr__(self, "axis", "token")
            object.__setattr__(self, "group", 0)
        elif self.group < 1:
            raise ValueError(f"group must be positive, got {self.group}")

    @property
    def full(self) -> bool:
        return self.bits == 16


FULL = KVFormat(16)
INT8 = KVFormat(8, "int8_sym")
FP8 = KVFormat(8, "fp8")
INT4_TOKEN = KVFormat(4, "int", "token", 32)
KIVI2_KEY, KIVI2_VALUE = KVFormat(2, "int", "channel", 32), KVFormat(2, "int", "token", 32)
KIVI4_KEY, KIVI4_VALUE = KVFormat(4, "int", "channel", 32), KVFormat(4, "int", "token", 32)
# (key format, value format) by name
PRESETS: dict[str, tuple[KVFormat, KVFormat]] = {
    "full": (FULL, FULL),
    "kivi2": (KIVI2_KEY, KIVI2_VALUE),
    "kivi4": (KIVI4_KEY, KIVI4_VALUE),
    "int8": (INT8, INT8),
    "fp8": (FP8, FP8),
    "int4": (INT4_TOKEN, INT4_TOKEN),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedBlock:
    """A quantized block of T tokens of one or more KV heads; the shapes follow the format (x is f[..., T, H]).

    "int", token groups:   codes u8[..., T, H*bits/8], scale / zero f16[..., T, H/group]
    "int", channel groups: codes u8[..., T, H*bits/8], scale / zero f16[..., T/group, H]
    "int8_sym":            codes i8[..., T, H], scale f16[..., T, 1], zero None
    "fp8":                 codes f8e4m3fn[..., T, H], scale f16[..., T, 1], zero None
    full (bits 16):        codes = x itself, scale / zero None
    """

    codes: jax.Array
    scale: jax.Array | None
    zero: jax.Array | None


def pack(codes: jax.Array, bits: int) -> jax.Array:  # u8[..., n] -> u8[..., ceil(n*bits/8)]
    """Pack codes of `bits` (2, 4, 8) bits, 8 / bits to a byte along the last axis, the first in the lowest bits.

    Codes are masked to their low `bits` bits; a last axis that is not a multiple of 8 / bits is padded with 0s.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    codes = codes.astype(jnp.uint8) & (2**bits - 1)  # u8[..., n]
    per = 8 // bits
    if per == 1:
        return codes
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, -codes.shape[-1] % per)])  # u8[..., n']
    grouped = codes.reshape(*codes.shape[:-1], -1, per)  # u8[..., n'/per, per]
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits  # u8[per]
    return jnp.sum(grouped << shifts, axis=-1, dtype=jnp.uint8)  # disjoint bits: the sum is the OR


def unpack(packed: jax.Array, bits: int, n: int) -> jax.Array:  # u8[..., B] -> u8[..., n]
    """The first `n` codes of `bits` bits packed by `pack` (its exact inverse)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    per = 8 // bits
    if per == 1:
        return packed[..., :n]
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits  # u8[per]
    codes = (packed[..., None] >> shifts) & jnp.uint8(2**bits - 1)  # u8[..., B, per]
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


def _check(fmt: KVFormat, tokens: int, head_dim: int) -> None:
    if head_dim * fmt.bits % 8:
        raise ValueError(f"head_dim {head_dim} does not pack into whole bytes at {fmt.bits} bits")
    if fmt.kind == "int" and not fmt.full:
        along, size = (head_dim, "head_dim") if fmt.axis == "token" else (tokens, "the token count")
        if along % fmt.group:
            raise ValueError(f"{fmt.axis}-axis group {fmt.group} does not divide {size} {along}")


def _grouped_shape(fmt: KVFormat, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """[..., T, H] split into groups, and the axis a group runs along (the one reduced for its scale)."""
    *lead, t, h = shape
    if fmt.axis == "token":
        return (*lead, t, h // fmt.group, fmt.group), -1
    return (*lead, t // fmt.group, fmt.group, h), -2


def _nonzero(scale: jax.Array) -> jax.Array:  # a zero scale (constant group) divides by 1: code 0
    return jnp.where(scale == 0, 1.0, scale)


def quantize(x: jax.Array, fmt: KVFormat) -> QuantizedBlock:
    """Quantize x f[..., T, H] (T tokens, H = head_dim) to `fmt`; see `QuantizedBlock` for the shapes."""
    if fmt.full:
        return QuantizedBlock(x, None, None)
    *_, t, h = x.shape
    _check(fmt, t, h)
    x = x.astype(jnp.float32)  # f32[..., T, H]
    if fmt.kind in ("int8_sym", "fp8"):
        top = 127.0 if fmt.kind == "int8_sym" else _FP8_MAX
        scale = (jnp.max(jnp.abs(x), axis=-1, keepdims=True) * (1 / top)).astype(SCALE_DTYPE)  # f16[..., T, 1]
        y = jnp.clip(x / _nonzero(scale.astype(jnp.float32)), -top, top)  # f32[..., T, H]
        codes = jnp.round(y).astype(jnp.int8) if fmt.kind == "int8_sym" else y.astype(jnp.float8_e4m3fn)
        return QuantizedBlock(codes, scale, None)  # codes i8 / f8e4m3fn[..., T, H]
    shape, axis = _grouped_shape(fmt, x.shape)
    xg = x.reshape(shape)  # f32[..., T, H/g, g] (token) or f32[..., T/G, G, H] (channel)
    lo, hi = jnp.min(xg, axis=axis, keepdims=True), jnp.max(xg, axis=axis, keepdims=True)  # f32, group axis 1
    levels = 2**fmt.bits - 1
    scale = ((hi - lo) * (1 / levels)).astype(SCALE_DTYPE)  # f16, group axis 1
    zero = lo.astype(SCALE_DTYPE)  # f16, group axis 1
    y = (xg - zero.astype(jnp.float32)) / _nonzero(scale.astype(jnp.float32))
    codes = jnp.clip(jnp.round(y), 0, levels).astype(jnp.uint8).reshape(x.shape)  # u8[..., T, H]
    # u8[..., T, H*bits/8]; f16[..., T, H/g] (token) or f16[..., T/G, H] (channel)
    return QuantizedBlock(pack(codes, fmt.bits), jnp.squeeze(scale, axis), jnp.squeeze(zero, axis))


def dequantize(block: QuantizedBlock, fmt: KVFormat) -> jax.Array:  # f32[..., T, H]
    """The float32 values `block` (quantized to `fmt`) stands for."""
    if fmt.full:
        return block.codes.astype(jnp.float32)
    scale = block.scale.astype(jnp.float32)
    if fmt.kind in ("int8_sym", "fp8"):
        return block.codes.astype(jnp.float32) * scale  # f32[..., T, H] * f32[..., T, 1]
    *lead, t, nbytes = block.codes.shape
    h = nbytes * 8 // fmt.bits
    codes = unpack(block.codes, fmt.bits, h).astype(jnp.float32)  # f32[..., T, H]
    shape, axis = _grouped_shape(fmt, (*lead, t, h))
    scale, zero = jnp.expand_dims(scale, axis), jnp.expand_dims(block.zero.astype(jnp.float32), axis)
    return (codes.reshape(shape) * scale + zero).reshape(*lead, t, h)


def bytes_per_token(fmt: KVFormat, head_dim: int) -> float:
    """Bytes one token's key (or value) of one KV head costs in `fmt`: its codes plus its share of scales and zeros.

    Full precision counts bf16 (2 bytes an element, even where the engine holds f32); int8_sym and fp8 one byte an
    element plus one f16 scale. "int" stores one f16 scale and one f16 zero per group: H/group groups per token for
    token groups, H groups per `group` tokens for channel groups -- H/group per token either way.
    """
    if fmt.full:
        return 2.0 * head_dim
    if fmt.kind != "int":
        return head_dim + 2.0
    _check(fmt, fmt.group, head_dim)
    return head_dim * fmt.bits / 8 + 2 * 2 * head_dim / fmt.group

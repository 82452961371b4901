"""Flax NNX Qwen3 decoder (also Qwen2 / Qwen2.5 and Llama-family checkpoints).

One module covers the three families because they differ only in flags:

| family         | q/k/v bias | q_norm / k_norm | example                 |
|----------------|------------|-----------------|-------------------------|
| Qwen3          | no         | yes             | Qwen3-0.6B ... 8B       |
| Qwen2 / 2.5    | yes        | no              | Qwen2.5-Coder-0.5B      |
| Llama          | no         | no              | SmolLM2-135M            |

Axis letters used in every einsum and shape comment:
B batch, T query tokens, S key tokens, D model width, N query heads, K KV heads,
G query heads per KV head (N = K * G), H head dim, F MLP width, V vocabulary.

Attention is split into `project` (q/k/v with norms and RoPE) and a separate attention
function, so that a KV cache plugs in between: the full forward below attends to the
tokens it was given; the engine attends to its cache.

On a device mesh the parameters are laid out by `models/sharding.py`'s table, and the activations below are
constrained with the same logical axes (`constrain`: a no-op without an active mesh).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pask_jax.attention import attention
from pask_jax.models.sharding import constrain

# attend(layer_index, q f[B, T, N, H], k f[B, T, K, H], v f[B, T, K, H]) -> f[B, T, N, H]
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder checkpoint; presets below, readers in `models/config_io.py`."""

    name: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_theta: float
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2 / Qwen2.5
    qk_norm: bool = False  # Qwen3
    architecture: str = "qwen3"  # "qwen3" | "qwen2" | "llama": informational, flags decide the math

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def group_size(self) -> int:  # G: query heads sharing one KV head
        return self.num_heads // self.num_kv_heads

    # Named presets for real checkpoints (values from their config.json / GGUF headers) and tiny test models.
    @classmethod
    def qwen3_0_6b(cls) -> ModelConfig:
        return cls("qwen3-0.6b", 151936, 1024, 3072, 28, 16, 8, 128, 1e6, qk_norm=True)

    @classmethod
    def qwen3_1_7b(cls) -> ModelConfig:
        return cls("qwen3-1.7b", 151936, 2048, 6144, 28, 16, 8, 128, 1e6, qk_norm=True)

    @classmethod
    def qwen3_4b(cls) -> ModelConfig:
        return cls("qwen3-4b", 151936, 2560, 9728, 36, 32, 8, 128, 1e6, qk_norm=True)

    @classmethod
    def qwen3_8b(cls) -> ModelConfig:
        return cls("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, 1e6, qk_norm=True, tie_embeddings=False)

    @classmethod
    def qwen2_5_coder_0_5b(cls) -> ModelConfig:
        return cls("qwen2.5-coder-0.5b", 151936, 896, 4864, 24, 14, 2, 64, 1e6, qkv_bias=True, architecture="qwen2")

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        return cls("smollm2-135m", 49152, 576, 1536, 30, 9, 3, 64, 1e5, rms_eps=1e-5, architecture="llama")

    @classmethod
    def tiny(cls, architecture: str = "qwen3", tie_embeddings: bool = True, **overrides) -> ModelConfig:
        """A few-kB random model for tests: 2 layers, GQA 4/2, one of the three families."""
        flags = {
            "qwen3": dict(qk_norm=True),
            "qwen2": dict(qkv_bias=True),
            "llama": dict(),
        }[architecture]
        fields = dict(
            name=f"tiny-{architecture}",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=1e4,
            tie_embeddings=tie_embeddings,
            architecture=architecture,
            **flags,
        )
        return cls(**(fields | overrides))


PRESETS = {
    c.name: c
    for c in (
        ModelConfig.qwen3_0_6b(),
        ModelConfig.qwen3_1_7b(),
        ModelConfig.qwen3_4b(),
        ModelConfig.qwen3_8b(),
        ModelConfig.qwen2_5_coder_0_5b(),
        ModelConfig.smollm2_135m(),
    )
}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., dim]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, "rotate half" layout (HF / Qwen / Llama).

    x: f[B, T, heads, H]; positions: i32[B, T] (absolute positions, so kept cache entries keep theirs).
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nnx.Einsum("BTD,DNH->BTNH", (d, n, h), (n, h) if bias else None, param_dtype=dtype, rngs=rngs)
        self.k_proj = nnx.Einsum("BSD,DKH->BSKH", (d, k, h), (k, h) if bias else None, param_dtype=dtype, rngs=rngs)
        self.v_proj = nnx.Einsum("BSD,DKH->BSKH", (d, k, h), (k, h) if bias else None, param_dtype=dtype, rngs=rngs)
        self.o_proj = nnx.Einsum("BTNH,NHD->BTD", (n, h, d), param_dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(h, cfg.rms_eps, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(h, cfg.rms_eps, dtype=dtype) if cfg.qk_norm else None
        self.rope_theta = cfg.rope_theta

    def output(self, o: jax.Array) -> jax.Array:
        """o_proj: f[B, T, N, H] -> f[B, T, D] as one [N*H, D] matmul (a free reshape of the (N, H, D) kernel).

        Spelled as a 2-D dot because XLA:CPU re-lays out the 3-D kernel on every call of the "BTNH,NHD" einsum.
        """
        b, t, n, h = o.shape
        kernel = self.o_proj.kernel[...]
        return jnp.dot(o.reshape(b, t, n * h), kernel.reshape(n * h, kernel.shape[-1]))

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: f[B, T, D], positions: i32[B, T] -> q f[B, T, N, H], k f[B, T, K, H], v f[B, T, K, H]."""
        q = constrain(self.q_proj(x), "batch", None, "heads", None)
        k = constrain(self.k_proj(x), "batch", None, "kv_heads", None)
        v = constrain(self.v_proj(x), "batch", None, "kv_heads", None)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta), v


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nnx.Einsum("BTD,DF->BTF", (d, f), param_dtype=dtype, rngs=rngs)
        self.up_proj = nnx.Einsum("BTD,DF->BTF", (d, f), param_dtype=dtype, rngs=rngs)
        self.down_proj = nnx.Einsum("BTF,FD->BTD", (f, d), param_dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # f[B, T, D]
        hidden = constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), "batch", None, "mlp")  # f[B, T, F]
        return self.down_proj(hidden)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)


class Decoder(nnx.Module):
    """Decoder-only LM. `model(tokens)` is the plain causal forward; `layers` are exposed for cached paths."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            # [V, D] like the embedding (and torch's layout): the logits matmul is fastest this way round on CPU
            else nnx.Einsum("BTD,VD->BTV", (cfg.vocab_size, cfg.hidden_size), param_dtype=dtype, rngs=rngs)
        )

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: f[B, T, D] -> f32[B, T, V]."""
        x = self.final_norm(x)
        if self.lm_head is None:
            out = jnp.einsum("BTD,VD->BTV", x, self.embed.embedding[...], preferred_element_type=jnp.float32)
        else:
            out = self.lm_head(x)
        return constrain(out.astype(jnp.float32), "batch", None, "vocab")

    def forward(self, tokens: jax.Array, positions: jax.Array, attend: AttendFn) -> jax.Array:
        """Hidden states before the final norm, f[B, T, D]; `attend(layer_index, q, k, v)` supplies attention.

        The attend callback is where a cache plugs in: it may store k / v, attend to cached entries, or record
        attention statistics. It runs at trace time, so a Python closure over cache arrays works under `jax.jit`.
        """
        x = constrain(self.embed(tokens), "batch", None, None)  # the residual stream: whole on every model shard
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.project(layer.input_norm(x), positions)
            x = x + layer.attn.output(attend(i, q, k, v))
            x = constrain(x + layer.mlp(layer.post_attn_norm(x)), "batch", None, None)
        return x

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]
        positions: jax.Array | None = None,  # i32[B, T], default 0..T-1
        valid: jax.Array | None = None,  # bool[B, T], False for padding
    ) -> jax.Array:  # f32[B, T, V]
        """Full causal forward, no cache: every token attends to all valid tokens at or before it."""
        b, t = tokens.shape
        causal = positions is None  # given positions need not increase along the sequence
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if valid is None:
            valid = jnp.ones((b, t), bool)
        mask = (positions[:, :, None] >= positions[:, None, :]) & valid[:, None, :] & valid[:, :, None]
        hidden = self.forward(tokens, positions, lambda _, q, k, v: attention(q, k, v, mask, causal=causal))
        return self.logits(hidden)

"""Load real checkpoints into the NNX decoder: HF safetensors directories and GGUF files.

Both formats go through one declarative table, `hf_key_table`, mapping a Hugging Face tensor name
to a parameter path of `Qwen3` and a layout transform. GGUF tensor names are first renamed to
their HF names (`GGUF_TO_HF`), dequantized with the `gguf` package, and llama.cpp's Q/K row
permutation is undone for llama-architecture files, so a GGUF and its safetensors twin load alike.

`dtype` is the weights' dtype (and so the activations' and the KV cache's); `resolve_dtype` gives the default, bfloat16
on accelerators and float32 on CPU. With a `mesh`, each tensor goes from the host straight onto the devices with its
sharding from `models/sharding.py` (no device ever holds the whole model unless the table replicates it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open

from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.models.fetch import MODELS, resolve_model_path
from pask_jax.models.sharding import check_mesh, param_spec

SUPPORTED_ARCHITECTURES = {
    # HF model_type / GGUF general.architecture -> flags
    "qwen3": dict(qk_norm=True),
    "qwen2": dict(qkv_bias=True),
    "llama": dict(),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unknown architecture, missing tensor, shape mismatch."""


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: str | jnp.dtype | None = None) -> jnp.dtype:
    """The weights' dtype: "float32", "bfloat16" (or a dtype); None or "auto": bfloat16 on TPU / GPU, float32 on CPU."""
    if dtype is None or dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    if jnp.dtype(dtype) not in {jnp.dtype(d) for d in DTYPES.values()}:
        raise ValueError(f"dtype {jnp.dtype(dtype)} is not one of {', '.join(DTYPES)}")
    return jnp.dtype(dtype)


def cast_model(model: Decoder, dtype) -> Decoder:
    """A copy of `model` with every parameter in `dtype` (the model itself is unchanged; same dtype: itself)."""
    dtype = resolve_dtype(dtype)
    if model.embed.embedding.dtype == dtype:
        return model
    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), params))


def _architecture_flags(arch: str, source: str) -> dict:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unknown architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return SUPPORTED_ARCHITECTURES[arch]


def config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """Read a transformers `config.json` dict (4.x keeps `rope_theta` top-level, 5.x in `rope_parameters`)."""
    arch = hf.get("model_type", "")
    flags = _architecture_flags(arch, "config.json")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise CheckpointError(f"config.json: RoPE scaling {rope_type!r} is not supported (only plain RoPE)")
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise CheckpointError("config.json: no rope_theta (top-level or in rope_parameters)")
    if arch == "llama" and hf.get("attention_bias"):
        flags = flags | {"qkv_bias": True}
    heads = hf["num_attention_heads"]
    return ModelConfig(
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        architecture=arch,
        **flags,
    )


def config_from_gguf(reader: gguf.GGUFReader, name: str = "gguf") -> ModelConfig:
    """Read the architecture from GGUF metadata; tied embeddings iff the file has no `output.weight`."""

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture", "")
    flags = _architecture_flags(arch, "GGUF")
    hidden, heads = field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight")
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=field(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", heads),
        head_dim=field(f"{arch}.attention.key_length", hidden // heads),
        rope_theta=float(field(f"{arch}.rope.freq_base", 1e4)),
        rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_embeddings="output.weight" not in names,
        architecture=arch,
        **flags,
    )


# ---- the declarative table: HF tensor name -> (param path, layout transform) ----

Transform = Callable[[np.ndarray], np.ndarray]


def hf_key_table(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    """Every tensor the model needs, keyed by its HF name. torch Linear weights are [out, in]."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    heads_in = {"q": n, "k": k, "v": k}

    def identity(w):
        return w

    def transpose(w):  # [out, in] -> [in, out]
        return w.T

    table = {
        "model.embed_tokens.weight": ("embed.embedding", identity),
        "model.norm.weight": ("final_norm.scale", identity),
    }
    if not cfg.tie_embeddings:
        table["lm_head.weight"] = ("lm_head.kernel", identity)  # kept [V, D]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        table[f"{hf}.input_layernorm.weight"] = (f"{ours}.input_norm.scale", identity)
        table[f"{hf}.post_attention_layernorm.weight"] = (f"{ours}.post_attn_norm.scale", identity)
        for p, heads in heads_in.items():  # [heads*H, D] -> [D, heads, H]
            table[f"{hf}.self_attn.{p}_proj.weight"] = (
                f"{ours}.attn.{p}_proj.kernel",
                lambda w, heads=heads: w.T.reshape(d, heads, h),
            )
            if cfg.qkv_bias:
                table[f"{hf}.self_attn.{p}_proj.bias"] = (
                    f"{ours}.attn.{p}_proj.bias",
                    lambda w, heads=heads: w.reshape(heads, h),
                )
        table[f"{hf}.self_attn.o_proj.weight"] = (f"{ours}.attn.o_proj.kernel", lambda w: w.T.reshape(n, h, d))
        if cfg.qk_norm:
            table[f"{hf}.self_attn.q_norm.weight"] = (f"{ours}.attn.q_norm.scale", identity)
            table[f"{hf}.self_attn.k_norm.weight"] = (f"{ours}.attn.k_norm.scale", identity)
        for p in ("gate", "up", "down"):
            table[f"{hf}.mlp.{p}_proj.weight"] = (f"{ours}.mlp.{p}_proj.kernel", transpose)
    return table


GGUF_TO_HF = [  # llama.cpp tensor name -> HF tensor name
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_([qkv])\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
]


def gguf_name_to_hf(name: str) -> str | None:
    for pattern, replacement in GGUF_TO_HF:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def unpermute_llama_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row permutation (interleaved -> rotate-half RoPE layout)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- tensor sources ----


def safetensors_tensors(directory: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) for a single-file or sharded (`model.safetensors.index.json`) checkpoint."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    for file in files:
        with safe_open(directory / file, framework="flax") as f:  # flax: keeps bfloat16 checkpoints readable
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                yield name, np.asarray(f.get_tensor(name).astype(jnp.float32))


def gguf_tensors(reader: gguf.GGUFReader, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in torch [out, in] layout) for every tensor of a GGUF file."""
    for tensor in reader.tensors:
        name = gguf_name_to_hf(tensor.name)
        if name is None:
            continue
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        w = w.reshape(tuple(reversed([int(s) for s in tensor.shape])))
        if cfg.architecture == "llama" and re.search(r"self_attn\.[qk]_proj\.weight$", name):
            w = unpermute_llama_qk(w, cfg.num_heads if ".q_proj" in name else cfg.num_kv_heads)
        yield name, w


# ---- assembling the model ----


def _param(model: nnx.Module, path: str) -> nnx.Variable:
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def build_model(
    cfg: ModelConfig,
    tensors: Iterator[tuple[str, np.ndarray]],
    dtype: jnp.dtype = jnp.float32,
    source: str = "",
    mesh: Mesh | None = None,
) -> Decoder:
    """Fill an uninitialised model (`nnx.eval_shape`: no random init) from (HF name, array) pairs; with a `mesh`,
    every parameter is placed on it with its table sharding."""
    if mesh is not None:
        check_mesh(mesh)
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    table = hf_key_table(cfg)
    loaded = set()
    for name, array in tensors:
        if name not in table:
            continue  # e.g. rotary inv_freq buffers, or an lm_head stored beside tied embeddings
        path, transform = table[name]
        value = transform(array)
        param = _param(model, path)
        if value.shape != param.shape:
            raise CheckpointError(f"{source}: {name} has shape {value.shape} after layout, expected {param.shape}")
        if mesh is None:
            param.set_value(jnp.asarray(value, dtype))
        else:  # host -> devices, each device receiving its own shard
            sharding = NamedSharding(mesh, param_spec(path, value.shape, mesh.shape))
            param.set_value(jax.device_put(np.asarray(value).astype(dtype), sharding))
        loaded.add(name)
    missing = sorted(set(table) - loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensors {missing[:5]}{more}")
    return model


def load_hf_checkpoint(directory: str | Path, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None) -> Decoder:
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{directory}: not a Hugging Face checkpoint (no config.json)")
    cfg = config_from_hf(json.loads(config_path.read_text()), name=directory.name)
    return build_model(cfg, safetensors_tensors(directory), dtype, source=str(directory), mesh=mesh)


def load_gguf(
    path: str | Path, dtype: jnp.dtype = jnp.float32, name: str | None = None, mesh: Mesh | None = None
) -> Decoder:
    path = Path(path)
    reader = gguf.GGUFReader(path)
    cfg = config_from_gguf(reader, name=name or path.stem)
    return build_model(cfg, gguf_tensors(reader, cfg), dtype, source=str(path), mesh=mesh)


def load_config(path_or_name: str | Path) -> ModelConfig:
    """The architecture of a checkpoint without reading its weights (config.json, or the GGUF header)."""
    path = resolve_model_path(path_or_name)
    name = str(path_or_name) if str(path_or_name) in MODELS else None
    if path.is_dir():
        return config_from_hf(json.loads((path / "config.json").read_text()), name=name or path.name)
    return config_from_gguf(gguf.GGUFReader(path), name=name or path.stem)


def load_model(path_or_name: str | Path, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None) -> Decoder:
    """An HF checkpoint directory, a `.gguf` file, a registered name (`qwen2.5-coder-0.5b`) or an HF repo id;
    with a `mesh`, loaded straight onto it."""
    path = resolve_model_path(path_or_name)
    if path.is_dir():
        return load_hf_checkpoint(path, dtype, mesh)
    return load_gguf(path, dtype, name=str(path_or_name) if str(path_or_name) in MODELS else None, mesh=mesh)

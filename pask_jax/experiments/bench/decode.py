"""Prefill and decode throughput: our JAX engine vs transformers' PyTorch `generate`, same checkpoint, same prompts.

    pask-jax bench decode [--quick] [--new-tokens 32] [--batches 1,8] [--prompt-tokens N]
                          [--out results/bench_decode.json]

Needs torch and transformers (the `test` extra). Both sides run the same GGUF (`qwen2.5-coder-0.5b` by default) in
fp32, greedy, on the same BFCL Qwen FC prompts (the first B items of `simple_python`, tokenised with our tokenizer),
with no stop token so that every request generates exactly N tokens. With --prompt-tokens N each item's prompt is
instead its long-context prompt of at most N tokens (`bfcl.long_context`: the item's question and functions
among distractor functions, in the same BFCL prompt); the lengths used are reported per batch. For each batch size
each side gets one untimed warm-up call with the same prompts and compiled shapes but only --warmup-tokens new tokens
(our decode capacity is bucketed in steps of 64 new tokens, so the executables are the same; `backend_compiles`
checks that the timed calls compile nothing; the warm-up's time, which for us includes the XLA compiles, is reported
separately), then `--repeats` timed calls, the two sides interleaved (ours, transformers, ours, ...) so that
background load on a shared machine hits both alike; the median of the repeats is reported.

What is timed (both sides: the first output token comes from the prefill logits, N-1 decode steps follow):
- ours: `Engine.generate` stats: `ttft_s` (prefill + first token on the host) and `token_times_s` (wall time of each
  decode step, host loop included). Our engine pads prompts to a length bucket and the batch to a power of two; the
  token counts and rates below are real (unpadded) tokens, the padded shapes are reported next to them.
- transformers: one `model.generate(do_sample=False, max_new_tokens=N)` call over the left-padded batch (with its
  attention mask, pad id 151643, no EOS so it never stops early), timed from inside by a no-op logits processor that
  stamps the wall clock each time generate hands it a step's logits. The first stamp minus the call start is the
  prefill (+ generate's set-up), the gaps between stamps are the decode steps (each: pick the token, update the
  DynamicCache, one forward). This is what a user of `generate` experiences, unlike a hand-written cache loop.

At batch 1 a third side runs interleaved with the two: transformers with 1 torch thread (torch's OpenMP waits at
every op for all its threads, which on a small machine shared with other jobs can dominate the step).

prefill tok/s = real prompt tokens of the batch / ttft; decode tok/s = B * steps / sum of step times; TPOT (ms per
output token per sequence) = sum of step times / steps. Ratios are ours / transformers (speedup > 1: ours faster).
Where a decode step's time goes: during the timed runs, forward hooks time transformers' model / decoder stack / LM
head on each step, and the engine's `on_step` timings give our jitted decode call until its outputs are on the host
(the rest of our step is the host loop); afterwards (unless --no-diagnose) the pieces of our step (layers without
cache, LM head, mask) are jitted and timed alone, next to the engine's real decode step on a prefilled cache, and the
compiled decode step's HLO (`Engine.lower`) is searched for per-step weight re-layouts.

Memory roofline of a decode step: a step must read every weight once (a tied LM head is the embedding, counted
once; an untied input embedding only for its B looked-up rows) and every live KV entry, so roofline_s = (weight
bytes + layers * kv_heads * head_dim * 2 (K and V) * dtype bytes * sum over the batch of (prompt length +
new_tokens / 2), the mean tokens per sequence a decode step attends to) / bandwidth, where bandwidth is the best of
a few timed in-place passes over a float32 array of --bandwidth-mib (bytes read + written per second: numpy
`copyto`, and a jitted `x * 2` with the input donated); each side's fraction of roofline is roofline_s / its
measured step time (TPOT), 1.0 = at the memory bound. Padding (our length bucket and power-of-two batch,
transformers' left padding) is not counted: it is work a side chooses to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pask_jax.experiments import bfcl
from pask_jax.experiments.bench.machine import code_state, compiles_so_far, machine_info
from pask_jax.experiments.bench.workloads import category_prompts
from pask_jax.experiments.bfcl.long_context import item_seed, long_context_prompt
from pask_jax.experiments.bfcl.prompt import format_tool_prompt
from pask_jax.factory import make_engine
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.rows import StepTiming
from pask_jax.runtime.sampling import SamplingConfig, mask_words, sample, unpack_mask
from pask_jax.runtime.shapes import BatchShape
from pask_jax.runtime.step import MethodInputs, StepInput
from pask_jax.structure.roles import NO_TOOL

if TYPE_CHECKING:
    import torch

PAD_ID = 151643  # <|endoftext|>, Qwen2.5's pad token
Thunk = tuple[Callable[[], None] | None, Callable[[], None]]  # (setup, run): run() is timed, blocks until done


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    model: str = "qwen2.5-coder-0.5b"
    category: str = "simple_python"  # BFCL category whose first B items are the prompts
    new_tokens: int = 32
    batches: tuple[int, ...] = (1, 8)
    warmup_tokens: int = 4  # new tokens of the untimed warm-up call (<= 64 keeps the timed calls' compiled shapes)
    repeats: int = 2
    threads: int = 2  # torch intra-op threads
    quick: bool = False  # fewer repeats of the decode-step pieces
    diagnose: bool = True  # time the decode-step pieces and read the compiled step's HLO
    thread_check: bool = True  # at batch 1, a third side: transformers on 1 torch thread
    prompt_tokens: int | None = None  # None: the BFCL prompts as they are; N: each item's long-context prompt <= N
    bandwidth_mib: int = 512  # float32 array the copy-bandwidth measurement passes over
    bandwidth_repeats: int = 5

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.new_tokens < 2 or not self.batches or min(self.batches) < 1:
            raise ValueError("need repeats >= 1, new_tokens >= 2 and batches >= 1")
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={self.prompt_tokens} must be >= 1 (or None: the BFCL prompts as they are)")
        if self.bandwidth_mib < 1 or self.bandwidth_repeats < 1:
            raise ValueError("need bandwidth_mib >= 1 and bandwidth_repeats >= 1")


# ---------------------------------------------------------------- prompts


def bench_prompts(tokenizer: Tokenizer, category: str, count: int, prompt_tokens: int | None = None) -> list[list[int]]:
    """Token ids of the first `count` items of a BFCL category: their BFCL prompts as they are, or with
    `prompt_tokens`, each item's long-context prompt (`long_context_prompt`, seeded by the item id) of at most that
    many tokens. Both sides of the benchmark get these ids."""
    if prompt_tokens is None:
        return category_prompts(tokenizer, category, count)
    items = bfcl.load_category(category)[:count]
    if len(items) < count:
        raise ValueError(f"BFCL category {category!r} has only {len(items)} items, {count} asked for")
    prompts = []
    for item in items:
        messages, tools = long_context_prompt(item, tokenizer, prompt_tokens, item_seed(item["id"]))
        ids = tokenizer.encode(format_tool_prompt(messages, tools))
        if len(ids) > prompt_tokens:  # the item's own prompt is longer than the target: nothing to pad
            raise ValueError(
                f"{item['id']}: its BFCL prompt alone has {len(ids)} tokens > prompt_tokens={prompt_tokens}"
            )
        prompts.append(ids)
    return prompts


# ---------------------------------------------------------------- memory roofline of a decode step


def copy_bandwidth(nbytes: int, repeats: int) -> dict:
    """This machine's memory bandwidth in GB/s (1e9 bytes read + written per second), from in-place passes over a
    float32 array of `nbytes`: numpy `copyto` into a second array (one thread), and a jitted `x * 2` whose input
    is donated (XLA's threads, no fresh output buffer to page in). One untimed pass each first; best and median of
    `repeats`; `gb_s` is the best of both, the bound a decode step could reach."""
    n = nbytes // 4
    moved = 2 * 4 * n  # bytes read + written per pass

    def rates(one_pass: Callable[[], None]) -> dict:
        one_pass()  # touches the pages (and compiles)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            one_pass()
            seconds.append(time.perf_counter() - t0)
        return {
            "best_gb_s": round(moved / min(seconds) / 1e9, 2),
            "median_gb_s": round(moved / statistics.median(seconds) / 1e9, 2),
        }

    arrays = {"src": np.ones(n, np.float32), "dst": np.empty(n, np.float32)}  # dropped after each measurement
    numpy_copy = rates(lambda: np.copyto(arrays["dst"], arrays["src"]))
    double = jax.jit(lambda x: x * 2.0, donate_argnums=0)
    arrays = {"x": jnp.ones(n, jnp.float32)}

    def xla_pass() -> None:
        arrays["x"] = jax.block_until_ready(double(arrays.pop("x")))

    xla_scale = rates(xla_pass)
    arrays.clear()
    return {
        "gb_s": max(numpy_copy["best_gb_s"], xla_scale["best_gb_s"]),
        "numpy_copyto": numpy_copy,
        "xla_scale_donated": xla_scale,
        "array_mib": round(nbytes / 2**20, 1),
        "repeats": repeats,
        "method": "bytes read + written per second over a float32 array (1e9 B/s); gb_s = best of the repeats, "
        "best of numpy copyto (1 thread) and jitted x * 2 with the input donated (in place, XLA's threads)",
    }


def weight_bytes(model: Decoder) -> dict:
    """Bytes of every parameter of `model` in its dtype (a tied LM head is the embedding: counted once), and of
    its embedding table."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return {
        "bytes": sum(x.nbytes for x in leaves),
        "parameters": sum(x.size for x in leaves),
        "embedding_bytes": model.embed.embedding[...].nbytes,
        "lm_head_tied": model.lm_head is None,
        "dtype": str(model.embed.embedding[...].dtype),
    }


def step_weight_bytes(weights: dict, vocab_size: int, batch: int) -> int:
    """Weight bytes one decode step of `batch` sequences reads (`weights` from `weight_bytes`): every parameter,
    except that an untied input embedding is only looked up, `batch` rows of it."""
    if weights["lm_head_tied"]:  # the table is read whole as the LM head
        return weights["bytes"]
    return weights["bytes"] - weights["embedding_bytes"] + batch * weights["embedding_bytes"] // vocab_size


def decode_step_roofline(
    cfg: ModelConfig, weights: dict, prompt_lengths: list[int], new_tokens: int, kv_itemsize: int, bandwidth_gb_s: float
) -> dict:
    """Bytes one decode step must read and the time that takes at `bandwidth_gb_s`.

    Decode step k (1..new_tokens-1) attends to prompt length + k KV entries per sequence; their mean over the steps
    is prompt length + new_tokens / 2. Every step reads the weights once (`step_weight_bytes`).
    """
    weights_read = step_weight_bytes(weights, cfg.vocab_size, len(prompt_lengths))
    tokens = sum(prompt_lengths) + len(prompt_lengths) * new_tokens / 2  # live KV tokens of the batch, mean step
    kv_bytes_per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * kv_itemsize  # K and V
    kv = kv_bytes_per_token * tokens
    return {
        "weight_bytes": weights_read,
        "kv_bytes": round(kv),
        "kv_tokens_mean_step": tokens,
        "kv_bytes_per_token": kv_bytes_per_token,
        "bytes": round(weights_read + kv),
        "roofline_step_ms": float(f"{1e3 * (weights_read + kv) / (1e9 * bandwidth_gb_s):.4g}"),
    }


def roofline_fractions(roofline: dict, sides: dict[str, dict]) -> dict:
    """roofline step time / each side's measured step time (`tpot_ms`): 1.0 = at the memory bound."""
    return {name: float(f"{roofline['roofline_step_ms'] / side['tpot_ms']:.4g}") for name, side in sides.items()}


# ---------------------------------------------------------------- where a decode step's time goes


class TorchProbe:
    """Forward hooks timing each call of the whole model, its decoder stack and its LM head during generate.

    The first call of a generate is the prefill; the rest are decode steps. The hooks cost microseconds a call.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.ms: dict[str, list[float]] = {"forward": [], "layers": [], "lm_head": []}
        self._t0: dict[str, float] = {}
        for name, module in (("forward", model), ("layers", model.model), ("lm_head", model.lm_head)):
            module.register_forward_pre_hook(self._pre(name))
            module.register_forward_hook(self._post(name))

    def _pre(self, name: str):
        def hook(module, args):
            self._t0[name] = time.perf_counter()

        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            self.ms[name].append(1e3 * (time.perf_counter() - self._t0[name]))

        return hook

    def take(self) -> dict[str, list[float]]:
        out, self.ms = self.ms, {k: [] for k in self.ms}
        return out


def hlo_copies(text: str) -> dict:
    """Weight re-layouts (transpose / copy ops whose source is `params[...]`) and other copies of >= 1e5 elements
    in an optimised HLO module: counts and MB, with a few examples."""
    itemsize = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
    out: dict = {"weight_relayout": {}, "other_big_copies": {}, "examples": []}
    pattern = re.compile(r"%[\w.\-]+ = (\w+)\[([\d,]*)\]\S* (transpose|copy)\(")
    for line in text.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        dtype, dims, op = m.groups()
        n = math.prod(int(d) for d in dims.split(",") if d)
        meta = re.search(r'op_name="([^"]*)"', line)
        name = meta.group(1) if meta else ""
        if "params[" in name and n >= 100_000:
            kind = "weight_relayout"
        elif op == "copy" and n >= 100_000:
            kind = "other_big_copies"
        else:
            continue
        entry = out[kind].setdefault(op, {"count": 0, "mb": 0.0})
        entry["count"] += 1
        entry["mb"] = round(entry["mb"] + n * itemsize.get(dtype, 4) / 2**20, 2)
        if len(out["examples"]) < 3:
            out["examples"].append(f"{op} {dtype}[{dims}] <- {name.replace(chr(92), '')}")
    return out


def decode_hlo_summary(engine: Engine, shape: BatchShape) -> dict:
    """Big data movement the compiled decode step does every step, read off its optimised HLO.

    Transposes / copies whose source is a weight (`params[...]` in the op metadata) re-lay out that weight on every
    step: extra weight-sized memory traffic on a step that is memory-bound. Other copies of >= 1e5 elements (e.g.
    a cache that is not updated in place) are counted separately.
    """
    t0 = time.perf_counter()
    out = hlo_copies(engine.lower(shape).decode.compile().as_text())
    out["inspect_s"] = round(time.perf_counter() - t0, 2)
    return out


def decode_step_replay(engine: Engine, prompts: list[list[int]], new_tokens: int) -> Thunk:
    """(setup, run) running the engine's real decode step on the cache its prefill fills for `prompts`.

    The shape is the one `generate` compiles for these prompts and `new_tokens`, so the executable is the timed
    runs' own. Each setup copies the prefilled caches (the step donates them).
    """
    shape = engine.batch_shape([len(p) for p in prompts], new_tokens)
    tokens, lengths, roles = shape.pad(prompts)
    logits, caches, _ = engine.prefill(tokens, lengths, roles, shape.capacities)
    first = np.asarray(jnp.argmax(logits, axis=-1), np.int32)  # i32[B]: greedy first tokens
    step_roles = np.zeros_like(lengths)
    bits = jnp.full((shape.padded_rows, mask_words(engine.cfg.vocab_size)), -1, jnp.int32)  # no constraint
    key = jax.random.key(0)
    state = {}

    def setup() -> None:
        state["caches"] = jax.block_until_ready(jax.tree.map(jnp.copy, caches))

    def run() -> None:
        step = StepInput(first, lengths, step_roles, lengths, MethodInputs(np.full_like(lengths, NO_TOOL)))
        out = engine.decode_step(state.pop("caches"), step, bits, key)
        jax.block_until_ready(out)

    return setup, run


def time_round_robin(thunks: dict[str, Thunk], reps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(median, min) wall ms of each (setup, run) pair's run(); one untimed round first, then `reps` rounds,
    interleaved so that background load on a shared machine hits every piece alike (and its min, the least
    disturbed run, is the better estimate of a piece's own cost). run() must block until its result is ready.
    """
    samples: dict[str, list[float]] = {name: [] for name in thunks}
    for r in range(reps + 1):
        for name, (setup, run) in thunks.items():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            run()
            if r:
                samples[name].append(1e3 * (time.perf_counter() - t0))
    return (
        {name: round(statistics.median(x), 2) for name, x in samples.items()},
        {name: round(min(x), 2) for name, x in samples.items()},
    )


def lm_head_weight(model: Decoder) -> jax.Array:
    """f[V, D]: the LM head's matrix (the embedding when they are tied)."""
    return (model.embed.embedding if model.lm_head is None else model.lm_head.kernel)[...]


def pieces(engine: Engine, model: Decoder, hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int, reps: int):
    """ms of the pieces of one decode step over `prompts` (at our padded batch), each jitted alone, timed interleaved.

    ours: the engine's real decode step (on the cache its prefill fills for these prompts), the layers at T=1 with
    attention to the token itself only (every weight read, no KV cache), the same with o_proj applied as a flat
    [N*H, D] matmul (does avoiding a per-step o_proj weight re-layout help? see decode_step_hlo), the layers + final
    norm + LM head + argmax, the LM head + argmax alone, the bare LM-head matmul, and the packed-mask unpack + argmax
    over the vocabulary that every step applies. real step - (layers + head) = the KV cache's share (write, attend
    over the pool, eviction bookkeeping). transformers: the bare LM-head matmul (torch threads as set), the same on
    1 thread.
    """
    import torch

    cfg = model.config
    batch = len(prompts)
    b = engine.batch_shape([len(p) for p in prompts], new_tokens).padded_rows
    graphdef, params = nnx.split(model)

    def self_attend(_, q, k, v):
        return jnp.repeat(v, cfg.group_size, axis=2)

    @jax.jit
    def layers(params, tok, positions):
        return nnx.merge(graphdef, params).forward(tok[:, None], positions[:, None], self_attend)

    @jax.jit
    def layers_flat_o_proj(params, tok, positions):
        m = nnx.merge(graphdef, params)
        x = m.embed(tok[:, None])
        for layer in m.layers:
            q, k, v = layer.attn.project(layer.input_norm(x), positions[:, None])
            out = self_attend(0, q, k, v)
            w = layer.attn.o_proj.kernel[...]
            x = x + out.reshape(*out.shape[:2], -1) @ w.reshape(-1, w.shape[-1])
            x = x + layer.mlp(layer.post_attn_norm(x))
        return x

    @jax.jit
    def layers_head(params, tok, positions):
        m = nnx.merge(graphdef, params)
        return jnp.argmax(m.logits(m.forward(tok[:, None], positions[:, None], self_attend))[:, 0], axis=-1)

    @jax.jit
    def head(params, h):
        return jnp.argmax(nnx.merge(graphdef, params).logits(h)[:, 0], axis=-1)

    @jax.jit
    def head_matmul(w, h):
        return jnp.einsum("BD,VD->BV", h, w)

    @jax.jit
    def mask_argmax(logits, bits):
        return sample(jnp.where(unpack_mask(bits, logits.shape[-1]), logits, -jnp.inf), None, 0.0, 1.0)

    tok = jnp.zeros((b,), jnp.int32)
    pos = jnp.full((b,), 300, jnp.int32)
    h = jnp.ones((b, 1, cfg.hidden_size), jnp.float32)
    w = lm_head_weight(model)
    bits = jnp.full((b, mask_words(cfg.vocab_size)), -1, jnp.int32)
    logits = jnp.ones((b, cfg.vocab_size), jnp.float32)
    hidden = torch.ones((batch, 1, cfg.hidden_size))
    threads = torch.get_num_threads()

    def torch_head(n: int) -> Thunk:
        def run() -> None:
            torch.set_num_threads(n)
            with torch.inference_mode():
                hf.lm_head(hidden)
            torch.set_num_threads(threads)

        return None, run

    def jitted(fn, *args) -> Thunk:
        return None, lambda: jax.block_until_ready(fn(*args))

    thunks = {
        "ours/decode_step_real": decode_step_replay(engine, prompts, new_tokens),
        "ours/layers_no_cache": jitted(layers, params, tok, pos),
        "ours/layers_no_cache_flat_o_proj": jitted(layers_flat_o_proj, params, tok, pos),
        "ours/layers_no_cache_plus_head_argmax": jitted(layers_head, params, tok, pos),
        "ours/final_norm_head_argmax": jitted(head, params, h),
        "ours/head_matmul_only": jitted(head_matmul, w, h[:, 0]),
        "ours/mask_unpack_argmax": jitted(mask_argmax, logits, bits),
        f"transformers/head_matmul_only_{threads}_threads": torch_head(threads),
        "transformers/head_matmul_only_1_thread": torch_head(1),
    }
    ms, ms_min = time_round_robin(thunks, reps)
    return {
        "batch": batch,
        "our_padded_batch": b,
        "reps": reps,
        "ms_median": ms,
        "ms_min": ms_min,
        "ours_cache_share_ms_from_min": round(
            ms_min["ours/decode_step_real"] - ms_min["ours/layers_no_cache_plus_head_argmax"], 2
        ),
        "ours_o_proj_relayout_cost_ms_from_min": round(
            ms_min["ours/layers_no_cache"] - ms_min["ours/layers_no_cache_flat_o_proj"], 2
        ),
        "weight_relayouts": {
            name: hlo_copies(fn.lower(params, tok, pos).compile().as_text())["weight_relayout"]
            for name, fn in (("layers_no_cache", layers), ("layers_no_cache_flat_o_proj", layers_flat_o_proj))
        },
    }


# ---------------------------------------------------------------- transformers side


def greedy_without_stop(model: torch.nn.Module, pad_id: int = PAD_ID) -> None:
    """Set `model.generate` to greedy decoding that never stops early, like our engine here."""
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, pad_id, False
    gc.temperature = gc.top_p = gc.top_k = None


def load_transformers(path: Path) -> tuple[torch.nn.Module, str]:
    """The GGUF through transformers' own loader, dequantised to fp32; returns (model, how it was loaded).

    `from_pretrained(gguf_file=...)` needs `accelerate`; without it we run the same GGUF reader/dequantiser
    (`load_gguf_checkpoint`, what from_pretrained calls) into a model built from the GGUF's config.
    """
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise ImportError("pask-jax bench decode needs torch and transformers: pip install 'pask-jax[test]'") from exc

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        how = "AutoModelForCausalLM.from_pretrained(gguf_file=...)"
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"GGUF state dict mismatch: missing {missing}, unexpected {unexpected}") from e
        model.tie_weights()
        how = "from_config + load_gguf_checkpoint (accelerate not installed, from_pretrained(gguf_file) refuses)"
    model.eval()
    greedy_without_stop(model)
    return model, how


class StepClock:
    """No-op logits processor: stamps the wall clock each time generate has a new step's logits."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    return ids, mask


def run_transformers(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, probe: TorchProbe, threads: int | None = None
) -> dict:
    """One timed `generate` call (on `threads` torch threads for this call, if given)."""
    import torch
    from transformers import LogitsProcessorList

    restore = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        ids, mask = left_pad(prompts, model.generation_config.pad_token_id)
        clock = StepClock()
        probe.take()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, logits_processor=LogitsProcessorList([clock])
            )
            wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(restore)
    tokens = out[:, ids.shape[1] :].tolist()
    if any(len(t) != new_tokens for t in tokens) or len(clock.stamps) != new_tokens:
        raise RuntimeError(f"transformers generated {[len(t) for t in tokens]} tokens, expected {new_tokens}")
    probed = probe.take()
    return {
        "ttft_s": clock.stamps[0] - t0,
        "step_s": [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)],
        "wall_s": wall,
        "tokens": tokens,
        "probe_ms": {k: v[1:] for k, v in probed.items()},  # decode calls only (the first is the prefill)
        "prefill_forward_ms": probed["forward"][0],
    }


# ---------------------------------------------------------------- our side


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """One timed `Engine.generate` call; `probe_ms.decode_call` is each decode step's jitted call (`on_step`)."""
    steps: list[StepTiming] = []
    t0 = time.perf_counter()
    gens = engine.generate(prompts, SamplingConfig(max_new_tokens=new_tokens), on_step=steps.append)
    wall = time.perf_counter() - t0
    if any(len(g.tokens) != new_tokens for g in gens):
        raise RuntimeError(f"our engine generated {[len(g.tokens) for g in gens]} tokens, expected {new_tokens}")
    stats = gens[0].stats  # one batch: every request shares the prefill time and the step times
    return {
        "ttft_s": stats.ttft_s,
        "step_s": list(stats.token_times_s),
        "wall_s": wall,
        "tokens": [g.tokens for g in gens],
        "probe_ms": {"decode_call": [1e3 * s.call_seconds for s in steps if s.step > 0]},
    }


# ---------------------------------------------------------------- summaries


def summarise(runs: list[dict], batch: int, prompt_tokens: int, warmup_s: float, warmup_steps: int) -> dict:
    ttft = statistics.median(r["ttft_s"] for r in runs)
    steps = len(runs[0]["step_s"])
    decode = statistics.median(sum(r["step_s"]) for r in runs)
    probes = {
        k: round(statistics.median(x for r in runs for x in r["probe_ms"][k]), 2) if runs[0]["probe_ms"][k] else None
        for k in runs[0]["probe_ms"]
    }
    out = {
        "prompt_tokens": prompt_tokens,
        "ttft_s": round(ttft, 4),
        "prefill_tok_s": round(prompt_tokens / ttft, 2),
        "decode_steps": steps,
        "decode_s": round(decode, 4),
        "decode_tok_s": round(batch * steps / decode, 3),
        "tpot_ms": round(1e3 * decode / steps, 2),
        "step_ms_median": round(1e3 * statistics.median(s for r in runs for s in r["step_s"]), 2),
        "step_probe_ms_median": probes,
        "wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
        "warmup_s": round(warmup_s, 3),
        "warmup_minus_run_s": round(warmup_s - ttft - (warmup_steps * decode / steps), 3),
        "repeats": len(runs),
        "per_repeat": [
            {"ttft_s": round(r["ttft_s"], 4), "decode_s": round(sum(r["step_s"]), 4), "wall_s": round(r["wall_s"], 3)}
            for r in runs
        ],
    }
    if "prefill_forward_ms" in runs[0]:
        out["prefill_forward_ms_median"] = round(statistics.median(r["prefill_forward_ms"] for r in runs), 1)
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def speedups(ours: dict, theirs: dict, warmup: bool = True) -> dict:
    """ours / theirs: prefill and decode speedups (> 1: ours faster), TPOT ratio (< 1: ours faster)."""
    out = {
        "prefill_speedup": round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 3),
        "decode_speedup": round(ours["decode_tok_s"] / theirs["decode_tok_s"], 3),
        "tpot_ratio": round(ours["tpot_ms"] / theirs["tpot_ms"], 3),
    }
    if warmup:
        out["warmup_ratio"] = round(ours["warmup_s"] / theirs["warmup_s"], 3)
    return out


# ---------------------------------------------------------------- one batch size, the whole run


def bench_batch(
    cfg: DecodeConfig, engine: Engine, hf: torch.nn.Module, probe: TorchProbe, prompts: list[list[int]]
) -> tuple[dict, list[list[int]], list[list[int]]]:
    """Warm-ups, then repeats interleaved across the sides -> (result entry, our tokens, transformers' tokens)."""
    batch = len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    longest = max(len(p) for p in prompts)
    shape = engine.batch_shape([len(p) for p in prompts], cfg.new_tokens)
    # Warm-up: same prompts, batch and compiled shapes (the decode capacity is bucketed in 64 new tokens), fewer steps.
    warmup_tokens = min(cfg.new_tokens, cfg.warmup_tokens)
    print(f"batch {batch}: {prompt_tokens} prompt tokens (longest {longest}), warming up ...", flush=True)

    compiles = compiles_so_far()
    t0 = time.perf_counter()
    run_ours(engine, prompts, warmup_tokens)
    warm_ours = time.perf_counter() - t0
    warmup_compiles = compiles_so_far() - compiles
    t0 = time.perf_counter()
    run_transformers(hf, prompts, warmup_tokens, probe)
    warm_hf = time.perf_counter() - t0
    # OpenMP (torch) splits each op statically over its threads and waits for all of them: on a 2-core machine
    # that other jobs share, every op can wait for a descheduled thread. At batch 1 a third side, transformers
    # on 1 thread, interleaved with the other two, shows how much of the comparison that is.
    one_thread = cfg.thread_check and batch == 1 and cfg.threads != 1
    if one_thread:
        run_transformers(hf, prompts, warmup_tokens, probe, threads=1)

    compiles = compiles_so_far()
    ours_runs, hf_runs, hf1_runs = [], [], []
    for r in range(cfg.repeats):
        ours_runs.append(run_ours(engine, prompts, cfg.new_tokens))
        hf_runs.append(run_transformers(hf, prompts, cfg.new_tokens, probe))
        line = (
            f"  repeat {r}: ours ttft {ours_runs[-1]['ttft_s']:.2f}s decode {sum(ours_runs[-1]['step_s']):.2f}s"
            f" | transformers ttft {hf_runs[-1]['ttft_s']:.2f}s decode {sum(hf_runs[-1]['step_s']):.2f}s"
        )
        if one_thread:
            hf1_runs.append(run_transformers(hf, prompts, cfg.new_tokens, probe, threads=1))
            line += f" | 1 thread ttft {hf1_runs[-1]['ttft_s']:.2f}s decode {sum(hf1_runs[-1]['step_s']):.2f}s"
        print(line, flush=True)
    timed_compiles = compiles_so_far() - compiles

    ours = summarise(ours_runs, batch, prompt_tokens, warm_ours, warmup_tokens - 1)
    padded_tokens = shape.prompt_bucket * shape.padded_rows
    ours["padding"] = {
        "length_bucket": shape.prompt_bucket,
        "batch_bucket": shape.padded_rows,
        "padded_prompt_tokens": padded_tokens,
        "real_fraction": round(prompt_tokens / padded_tokens, 3),
        "prefill_tok_s_padded": round(padded_tokens / ours["ttft_s"], 2),
    }
    ours["backend_compiles"] = {"warmup": warmup_compiles, "timed": timed_compiles}
    theirs = summarise(hf_runs, batch, prompt_tokens, warm_hf, warmup_tokens - 1)
    theirs["padding"] = {"left_padded_to": longest, "padded_prompt_tokens": longest * batch}

    our_tokens, hf_tokens = ours_runs[-1]["tokens"], hf_runs[-1]["tokens"]
    same = [a == b for a, b in zip(our_tokens, hf_tokens, strict=True)]
    lengths = [len(p) for p in prompts]
    entry = {
        "batch": batch,
        "prompt_lengths": {"min": min(lengths), "mean": round(statistics.mean(lengths), 1), "max": longest},
        "ours": ours,
        "transformers": theirs,
        "ours_over_transformers": speedups(ours, theirs),
        "same_greedy_tokens": {
            "rows_identical": sum(same),
            "rows": batch,
            "first_divergence": [first_divergence(a, b) for a, b in zip(our_tokens, hf_tokens, strict=True)],
        },
    }
    if hf1_runs:
        one = summarise(hf1_runs, batch, prompt_tokens, float("nan"), warmup_tokens - 1)
        one.pop("warmup_s"), one.pop("warmup_minus_run_s")
        entry["transformers_1_thread"] = one
        entry["ours_over_transformers_1_thread"] = speedups(ours, one, warmup=False)
        entry["same_greedy_tokens"]["transformers_1_thread_rows_identical"] = sum(
            a == b for a, b in zip(our_tokens, hf1_runs[-1]["tokens"], strict=True)
        )
    entry["loadavg_after"] = os.getloadavg()
    return entry, our_tokens, hf_tokens


def run_benchmark(
    cfg: DecodeConfig,
    model: Decoder,
    hf: torch.nn.Module,
    prompts: list[list[int]],
    decode_text: Callable[[list[int]], str] | None = None,
    about: dict | None = None,
    start: float | None = None,
) -> dict:
    """Every batch size of `cfg` on the first B `prompts`, both sides -> the result dict.

    `about` (checkpoint, load times, how transformers loaded it) goes into the result as given; `decode_text`, if
    given, records both sides' text of the first prompt at batch 1; `total_s` counts from `start` (a
    `time.perf_counter()` value; default: now).
    """
    import torch
    import transformers

    if len(prompts) < max(cfg.batches):
        raise ValueError(f"{len(prompts)} prompts for batches up to {max(cfg.batches)}")
    start = time.perf_counter() if start is None else start
    compiles_so_far()  # start listening before anything compiles
    engine = make_engine(model)  # Full KV, no stop tokens: exactly new_tokens per request
    probe = TorchProbe(hf)
    warmup_tokens = min(cfg.new_tokens, cfg.warmup_tokens)
    machine = machine_info() | {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
    }
    about = dict(about or {})
    print(f"copy bandwidth over {cfg.bandwidth_mib} MiB ...", flush=True)
    bandwidth = copy_bandwidth(cfg.bandwidth_mib << 20, cfg.bandwidth_repeats)
    weights = weight_bytes(model)
    kv_itemsize = jnp.dtype(engine.plan.dtype).itemsize
    if cfg.prompt_tokens is None:
        prompts_about = f"BFCL {cfg.category} items [0, B), Qwen FC prompt (bfcl_prompt), our tokenizer"
    else:
        prompts_about = (
            f"BFCL {cfg.category} items [0, B), each item's long-context prompt of at most {cfg.prompt_tokens} tokens "
            "(long_context_prompt: its question and functions among distractor functions, seeded by the item id, "
            "Qwen FC prompt), our tokenizer"
        )
    result: dict = {
        "model": cfg.model,
        "checkpoint": about.pop("checkpoint", None),
        "dtype": "float32",
        "decoding": "greedy, no stop token (every request generates exactly new_tokens)",
        "prompts": prompts_about,
        "prompt_tokens_target": cfg.prompt_tokens,
        "new_tokens": cfg.new_tokens,
        "batches": list(cfg.batches),
        "machine": machine,
        "code": code_state(),
        "load_s": about.pop("load_s", None),
        "method": {
            "ours": "Engine.generate stats: ttft_s (prefill + first token on host), token_times_s (each decode step)",
            "transformers": (
                "model.generate(max_new_tokens=N, greedy, left-padded + attention_mask, pad 151643, no eos), "
                "timed by a no-op LogitsProcessor stamping each step: ttft = first stamp - call start, "
                "decode steps = gaps between stamps (token pick + DynamicCache update + forward)"
            ),
            "transformers_load": about.pop("transformers_load", None),
            "attn_implementation": getattr(hf.config, "_attn_implementation", None),
            "timing": f"one untimed warm-up call per (side, batch) with the same prompts and compiled shapes and "
            f"{warmup_tokens} new tokens (warmup_s; warmup_minus_run_s = warm-up minus the same work timed warm, "
            "i.e. ~compile time), then repeats interleaved ours/transformers; median over repeats",
            "rates": "prefill_tok_s = real prompt tokens / ttft; decode_tok_s = B * steps / sum(step times); "
            "tpot_ms = sum(step times) / steps",
        },
        "roofline": {
            "bandwidth": bandwidth,
            "weights": weights,
            "kv_dtype_bytes": kv_itemsize,
            "formula": "roofline_step_ms = (weight bytes + layers * kv_heads * head_dim * 2 * kv dtype bytes * "
            "sum_b(prompt_len_b + new_tokens / 2)) / bandwidth; weight bytes = every parameter (a tied LM head once; "
            "an untied input embedding: only its B looked-up rows); fraction = roofline_step_ms / measured tpot_ms "
            "(1.0 = at the memory bound); real tokens only, padding not counted",
        },
        "results": [],
    }
    for batch in cfg.batches:
        entry, our_tokens, hf_tokens = bench_batch(cfg, engine, hf, probe, prompts[:batch])
        lengths = [len(p) for p in prompts[:batch]]
        roofline = decode_step_roofline(model.config, weights, lengths, cfg.new_tokens, kv_itemsize, bandwidth["gb_s"])
        sides = {name: entry[name] for name in ("ours", "transformers", "transformers_1_thread") if name in entry}
        entry["roofline"] = roofline | {"fraction": roofline_fractions(roofline, sides)}
        if batch == 1:
            result["sanity_batch1_first_prompt_identical"] = our_tokens[0] == hf_tokens[0]
            if decode_text is not None:
                texts = {"ours": our_tokens[0], "transformers": hf_tokens[0]}
                result["sanity_batch1_text"] = {side: decode_text(tokens) for side, tokens in texts.items()}
        result["results"].append(entry)
        keys = ("batch", "ours_over_transformers", "ours_over_transformers_1_thread", "same_greedy_tokens", "roofline")
        print(json.dumps({k: entry[k] for k in keys if k in entry}), flush=True)

    if cfg.diagnose:
        reps = 3 if cfg.quick else 5
        batches = {b: prompts[:b] for b in cfg.batches}
        result["decode_step_pieces"] = [pieces(engine, model, hf, ps, cfg.new_tokens, reps) for ps in batches.values()]
        result["decode_step_hlo"] = {
            str(b): decode_hlo_summary(engine, engine.batch_shape([len(p) for p in ps], cfg.new_tokens))
            for b, ps in batches.items()
        }
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["total_s"] = round(time.perf_counter() - start, 1)
    return result


def summary_table(result: dict) -> str:
    """Per batch size: prompt lengths and our padded shape, prefill and decode tok/s of both sides and ours /
    transformers, TPOT, the roofline step time and each side's fraction of it."""
    roof = result["roofline"]
    weights = roof["weights"]
    head = "tied, counted once" if weights["lm_head_tied"] else "untied"
    lines = [
        f"copy bandwidth {roof['bandwidth']['gb_s']} GB/s (best of numpy copyto / jitted x*2); weights "
        f"{weights['bytes'] / 1e6:.1f} MB {weights['dtype']} (LM head {head}); roof ms = roofline step time, "
        "of roof = roofline / measured TPOT",
        f"{'batch':>5} {'prompt mean/max':>15} {'padded':>9} | {'prefill tok/s ours/hf':>22} {'x':>6} | "
        f"{'decode tok/s ours/hf':>21} {'x':>6} | {'tpot ms ours/hf':>16} | {'roof ms':>8} {'of roof ours/hf':>16}",
    ]
    for e in result["results"]:
        ours, hf, ratio, pad = e["ours"], e["transformers"], e["ours_over_transformers"], e["ours"]["padding"]
        frac = e["roofline"]["fraction"]
        lines.append(
            f"{e['batch']:>5} {e['prompt_lengths']['mean']:>9.0f}/{e['prompt_lengths']['max']:<5} "
            f"{pad['batch_bucket']:>3}x{pad['length_bucket']:<5} | "
            f"{ours['prefill_tok_s']:>10.1f}/{hf['prefill_tok_s']:<11.1f} {ratio['prefill_speedup']:>6.2f} | "
            f"{ours['decode_tok_s']:>9.2f}/{hf['decode_tok_s']:<11.2f} {ratio['decode_speedup']:>6.2f} | "
            f"{ours['tpot_ms']:>7.1f}/{hf['tpot_ms']:<8.1f} | "
            f"{e['roofline']['roofline_step_ms']:>8.1f} {frac['ours']:>7.3f}/{frac['transformers']:<8.3f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pask-jax bench decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=DecodeConfig.model)
    ap.add_argument("--category", default=DecodeConfig.category, help="BFCL category whose first B items are prompts")
    ap.add_argument("--new-tokens", type=int, default=DecodeConfig.new_tokens)
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=DecodeConfig.warmup_tokens,
        help="new tokens of the untimed warm-up call (<= 64 keeps the timed calls' compiled shapes)",
    )
    ap.add_argument("--repeats", type=int, default=DecodeConfig.repeats, help="timed calls per (side, batch)")
    ap.add_argument("--threads", type=int, default=DecodeConfig.threads, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="batch 1 only, 8 new tokens (a smoke test)")
    ap.add_argument("--no-diagnose", dest="diagnose", action="store_false", help="skip the decode-step pieces")
    ap.add_argument(
        "--no-thread-check",
        dest="thread_check",
        action="store_false",
        help="skip the third side at batch 1: transformers on 1 torch thread (sensitivity to a shared machine)",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="each item's long-context prompt of at most N tokens (its functions among distractors); "
        "default: the BFCL prompts as they are",
    )
    ap.add_argument(
        "--bandwidth-mib",
        type=int,
        default=DecodeConfig.bandwidth_mib,
        help="float32 array (MiB) the copy-bandwidth measurement of the roofline passes over",
    )
    ap.add_argument("--out", type=Path, default=Path("results/bench_decode.json"))
    return ap


def config_from_args(args: argparse.Namespace) -> DecodeConfig:
    batches = "1" if args.quick else args.batches
    return DecodeConfig(
        model=args.model,
        category=args.category,
        new_tokens=8 if args.quick else args.new_tokens,
        batches=tuple(int(b) for b in batches.split(",")),
        warmup_tokens=args.warmup_tokens,
        repeats=args.repeats,
        threads=args.threads,
        quick=args.quick,
        diagnose=args.diagnose,
        thread_check=args.thread_check,
        prompt_tokens=args.prompt_tokens,
        bandwidth_mib=args.bandwidth_mib,
    )


def main(argv: list[str] | None = None) -> dict:
    """`pask-jax bench decode ARGS` -> the result dict (also written to --out)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    import torch

    from pask_jax.checkpoint import Checkpoint

    start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    checkpoint = Checkpoint.open(cfg.model)
    path, tokenizer = checkpoint.path, checkpoint.tokenizer
    prompts = bench_prompts(tokenizer, cfg.category, max(cfg.batches), cfg.prompt_tokens)
    t0 = time.perf_counter()
    model = checkpoint.weights("float32")
    load_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf, hf_how = load_transformers(path)
    load_hf = time.perf_counter() - t0
    about = {
        "checkpoint": str(path),
        "load_s": {"ours": round(load_ours, 2), "transformers": round(load_hf, 2)},
        "transformers_load": hf_how,
    }
    result = run_benchmark(cfg, model, hf, prompts, tokenizer.decode, about, start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("results", "total_s")}, indent=1)[:4000])
    print(summary_table(result))
    print(f"wrote {args.out}")
    return result

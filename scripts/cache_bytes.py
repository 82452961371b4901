"""Cache memory vs budget: bytes of the ragged KV cache the engine allocates, without allocating it.

    python scripts/cache_bytes.py --model qwen2.5-coder-0.5b --prompt-len 2048 --new-tokens 64 --batch 8

Capacity per (layer, sequence, KV head) is sized from the budget (`budget_capacity`), so bytes follow the budget.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from pask_jax.cache import GroupCache
from pask_jax.layers import layer_groups
from pask_jax.methods.base import budget_capacity
from pask_jax.models.qwen3 import PRESETS


def cache_bytes(preset: str, prompt_len: int, new_tokens: int, batch: int, budget: float, groups: int = 4) -> int:
    cfg = PRESETS[preset]
    capacity = budget_capacity(prompt_len, new_tokens, budget)
    total = 0
    for start, stop in layer_groups(cfg.num_layers, groups):
        shapes = jax.eval_shape(
            lambda n=stop - start: GroupCache.empty(n, batch, cfg.num_kv_heads, capacity, cfg.head_dim, jnp.float32)
        )
        total += GroupCache.nbytes(shapes)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("results/cache_bytes.json"))
    args = parser.parse_args()
    full = cache_bytes(args.model, args.prompt_len, args.new_tokens, args.batch, 1.0)
    rows = []
    for budget in (1.0, 0.5, 0.33, 0.2):
        nbytes = cache_bytes(args.model, args.prompt_len, args.new_tokens, args.batch, budget)
        rows.append({"budget": budget, "bytes": nbytes, "ratio_vs_full": round(nbytes / full, 4)})
        print(f"budget {budget:4.2f}: {nbytes / 2**20:8.1f} MiB  ({nbytes / full:.3f} of full)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

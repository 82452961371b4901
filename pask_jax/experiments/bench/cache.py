"""Cache memory vs budget: bytes of the ragged KV cache the engine allocates, computed from shapes alone.

    pask-jax bench cache --model qwen2.5-coder-0.5b --prompt-len 2048 --new-tokens 64 --batch 8

The model is built abstractly (`nnx.eval_shape`: no weights, no download), so any preset answers in seconds.
Capacity per (layer, sequence, KV head) is sized from the budget (`Engine.batch_shape`), so bytes follow the budget;
each row is `Engine.cache_bytes` of `--method` at that budget, against Full KV's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flax import nnx

from pask_jax.factory import make_engine
from pask_jax.models.decoder import PRESETS, Decoder

BUDGETS = (1.0, 0.5, 0.33, 0.2)


def cache_bytes_by_budget(
    preset: str, prompt_len: int, new_tokens: int, batch: int, method: str = "snapkv", budgets=BUDGETS
) -> list[dict]:
    """Per budget: `method`'s cache bytes for `batch` prompts of `prompt_len` tokens, and their share of Full KV's."""
    model = nnx.eval_shape(lambda: Decoder(PRESETS[preset], rngs=nnx.Rngs(0)))
    lengths = [prompt_len] * batch

    def nbytes(name: str, budget: float) -> int:
        engine = make_engine(model, name, budget)
        return engine.cache_bytes(engine.batch_shape(lengths, new_tokens))

    full = nbytes("full", 1.0)
    rows = []
    for budget in budgets:
        size = nbytes(method, budget)
        rows.append({"budget": budget, "bytes": size, "ratio_vs_full": round(size / full, 4)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    """`pask-jax bench cache ARGS` -> {"args", "rows"} (also written to --out)."""
    parser = argparse.ArgumentParser(
        prog="pask-jax bench cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--method", default="snapkv", help="a method whose layers all keep the budget's share")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("results/cache_bytes.json"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if min(args.prompt_len, args.new_tokens, args.batch) < 1:
        parser.error("--prompt-len, --new-tokens and --batch must be >= 1")
    rows = cache_bytes_by_budget(args.model, args.prompt_len, args.new_tokens, args.batch, args.method)
    for row in rows:
        print(f"budget {row['budget']:4.2f}: {row['bytes'] / 2**20:8.1f} MiB  ({row['ratio_vs_full']:.3f} of full)")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result

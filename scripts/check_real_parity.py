"""Slow check (not in CI): the real GGUF greedy-decodes like transformers' own GGUF load of the same file.

    python scripts/check_real_parity.py --model qwen2.5-coder-0.5b --n 5 --tokens 32 --out results/real_parity.json

Both sides get the same BFCL Qwen FC prompts as token ids (our tokenizer); fp32, greedy, no grammar.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from pask_jax import Engine, SamplingConfig, load_model, load_tokenizer, resolve_model_path
from pask_jax.experiments.bfcl import CATEGORIES, load_category
from pask_jax.experiments.bfcl.prompt import bfcl_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/real_parity.json"))
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(args.model)
    items = [load_category(c)[0] for c in CATEGORIES][: args.n]
    prompts = [tokenizer.encode(bfcl_prompt(item)) for item in items]

    t0 = time.perf_counter()
    ours = load_model(args.model)
    load_ours = time.perf_counter() - t0
    engine = Engine(ours)  # no stop tokens: compare all `tokens` steps
    t0 = time.perf_counter()
    our_tokens = [g.tokens for g in engine.generate(prompts, SamplingConfig(max_new_tokens=args.tokens))]
    gen_ours = time.perf_counter() - t0
    our_last_logits = [np.asarray(ours(np.asarray([prompt]))[0, -1]) for prompt in prompts]
    del engine, ours  # one model in memory at a time (the 1.5B model takes ~6 GB in float32 on each side)
    gc.collect()

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
    load_ref = time.perf_counter() - t0
    ref_tokens, first_logit_diff = [], []
    t0 = time.perf_counter()
    for prompt, our_logits in zip(prompts, our_last_logits, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=args.tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref_logits = ref(ids).logits[0, -1].numpy()
        ref_tokens.append(out[0, len(prompt) :].tolist())
        first_logit_diff.append(float(np.abs(our_logits - ref_logits).max()))
    gen_ref = time.perf_counter() - t0

    rows = [
        {
            "id": item["id"],
            "identical": a == b,
            "first_divergence": next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None),
            "ours": tokenizer.decode(a),
            "transformers": tokenizer.decode(b),
        }
        for item, a, b in zip(items, our_tokens, ref_tokens, strict=True)
    ]
    result = {
        "model": args.model,
        "tokens": args.tokens,
        "identical": sum(r["identical"] for r in rows),
        "n": len(rows),
        "max_abs_logit_diff_last_prompt_token": max(first_logit_diff),
        "load_s": {"ours": round(load_ours, 1), "transformers": round(load_ref, 1)},
        "generate_s": {"ours_batched": round(gen_ours, 1), "transformers_sequential": round(gen_ref, 1)},
        "items": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "items"}, indent=2))


if __name__ == "__main__":
    main()

"""Where PASK's floors put a needle: per layer group, how many prompt entries the policy's floors protect against the
layer's budget, and whether the needle's digits are among them. Roles and floors only: no model forward.

Floors protect the most recent ceil(floor * n) entries of each role; a needle prompt is one long user message, so at a
small budget the protected tail of the request alone can outnumber the entries a layer keeps, and every entry before
that tail (an earlier needle) is below all of them.

    python scripts/niah_floor_reach.py --seed 1 --lengths 4096,8192 --budgets 0.03,0.1 \
        --out results/niah_floor_reach_dev.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from pask_jax.checkpoint import Checkpoint
from pask_jax.experiments import niah
from pask_jax.layers import layer_groups
from pask_jax.methods.base import PROTECTED, PrefillContext
from pask_jax.methods.pask import POSITION_RANGE, TIER, PaskKV
from pask_jax.policy import PersistencePolicy
from pask_jax.requests import RequestBuilder


def needle_span(ids: list[int], digits: list[int]) -> range:
    """Token positions of the needle's number (its digits' token ids, found once in the prompt)."""
    n = len(digits)
    hits = [i for i in range(len(ids) - n + 1) if ids[i : i + n] == digits]
    if len(hits) != 1:
        raise SystemExit(f"the needle's number occurs {len(hits)} times in the prompt; expected once")
    return range(hits[0], hits[0] + n)


def reach(prompt: niah.NiahPrompt, method: PaskKV, tokenizer, groups: list[tuple[int, int]]) -> list[dict]:
    ids = list(prompt.prepared.ids)
    span = needle_span(ids, tokenizer.encode(prompt.needle.number))
    t = len(ids)
    ctx = PrefillContext(
        tokens=jnp.asarray([ids]),
        positions=jnp.arange(t)[None],
        valid=jnp.ones((1, t), bool),
        lengths=jnp.asarray([t]),
        roles=jnp.asarray([prompt.prepared.roles]),
        kv_heads=1,
        extra_query_scores=None,
    )
    rows = []
    for g, (first, _) in enumerate(groups):
        score = np.asarray(method.role_scores(first, ctx))[0, 0]  # f32[T]
        tier = np.where(score >= PROTECTED, 3, np.floor(score / POSITION_RANGE) // TIER)
        protected = tier >= 1
        rows.append(
            {
                "group": g,
                "kept_per_layer": math.ceil(method.group_fractions[g] * t),
                "protected": int(protected.sum()),
                "needle_protected": bool(protected[list(span)].all()),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--policy", default="pask_jax/policies/qwen2.5-coder-0.5b")
    parser.add_argument("--seed", type=int, default=1, help="needle seed (0 is the reported run's: use another)")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--depths", default="0,20,40,60,80,100")
    parser.add_argument("--budgets", default="0.03,0.1")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checkpoint = Checkpoint.open(args.model)
    policy = PersistencePolicy.load(args.policy)
    builder = RequestBuilder(checkpoint.tokenizer, checkpoint.chat_template)
    groups = layer_groups(policy.num_layers, policy.groups)
    rows = []
    for length in niah.parse_lengths(args.lengths):
        for haystack in niah.HAYSTACKS:
            for depth in niah.parse_floats(args.depths, "depths"):
                prompt = niah.build_prompt(builder, length, depth, haystack, seed=args.seed)
                for budget in niah.parse_floats(args.budgets, "budgets"):
                    method = PaskKV.from_policy(policy, budget)
                    for row in reach(prompt, method, checkpoint.tokenizer, groups):
                        rows.append(
                            {
                                "length": length,
                                "haystack": haystack,
                                "depth": depth,
                                "budget": budget,
                                "prompt_tokens": len(prompt.prepared.ids),
                                **row,
                            }
                        )
    Path(args.out).write_text(json.dumps({"policy": args.policy, "seed": args.seed, "rows": rows}, indent=1) + "\n")
    for budget in niah.parse_floats(args.budgets, "budgets"):
        for g in range(len(groups)):
            sel = [r for r in rows if r["budget"] == budget and r["group"] == g]
            ratio = np.mean([r["protected"] / r["kept_per_layer"] for r in sel])
            reached = [r for r in sel if r["needle_protected"]]
            depths = sorted({r["depth"] for r in reached})
            print(
                f"b={budget} group {g}: protected/kept {ratio:.2f}, needle protected at depths {depths}"
                f" ({len(reached)} of {len(sel)})"
            )


if __name__ == "__main__":
    main()

"""The user's path against the evaluation harness: `pask-jax run` and `pask-jax bfcl` on the same BFCL items.

    pask-jax bench entrypoints [--method pask --budget 0.33] [--per-category 8] [--out results/bench_entrypoints.json]

One model and one method. The items (the first K dev items of each category; throughput only, nothing is chosen
from them) go through
- `run`: `run_batch` over an OpenAI Batch JSONL of the items as a user would send them (`bfcl_request_body`: the
  checkpoint's own chat template, OpenAI tools), with its JSONL reading, request checks, grammar compiles,
  length-sorted micro-batches and flushed output lines;
- `bfcl`: `run_bfcl` on the same items (BFCL's fixed prompt, its checker).
Both run a batch size of --batch-size. A warm-up round of both (compiles) is reported apart; then --repeats timed
rounds, the two sides interleaved so that background load hits both alike. tokens/s = generated tokens / wall time of
the whole call (prompt building and grammar compiles included); the ratio is run / bfcl. The two prompts differ (the
template adds a system message and the tool envelope), so the token counts differ too; the calls are compared item
by item.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pask_jax.arguments import AUTO_POLICY, policy_spec
from pask_jax.experiments import bfcl
from pask_jax.experiments.bench.machine import machine_info

DEFAULT_CATEGORIES = ("simple_python", "multiple", "live_simple", "live_multiple")


def _run_side(llm, items: list[dict], max_tokens: int, workdir: Path, tag: str) -> dict:
    from pask_jax.batch_file import run_batch
    from pask_jax.experiments.bfcl.prompt import bfcl_request_body

    requests = workdir / f"requests_{tag}.jsonl"
    output = workdir / f"output_{tag}.jsonl"
    with requests.open("w") as f:
        for item in items:
            line = {"custom_id": item["id"], "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps(line | {"body": bfcl_request_body(item, max_tokens)}) + "\n")
    start = time.perf_counter()
    summary = run_batch(lambda: llm, requests, output)
    wall = time.perf_counter() - start
    calls = {}
    for line in output.read_text().splitlines():
        record = json.loads(line)
        message = record["response"]["body"]["choices"][0]["message"] if record["response"] else {}
        calls[record["custom_id"]] = [
            [c["function"]["name"], json.loads(c["function"]["arguments"])] for c in message.get("tool_calls") or []
        ]
    return {"wall_s": wall, "tokens": summary.output_tokens, "failed": summary.failed, "calls": calls}


def _bfcl_side(llm, cfg, policies: dict) -> dict:
    from pask_jax.experiments.bfcl.evaluate import run_bfcl

    start = time.perf_counter()
    result = run_bfcl(llm.model, llm.tokenizer, llm.model_name, cfg, policies=policies)
    wall = time.perf_counter() - start
    items = [r for run in result["runs"] for r in run["items"]]
    calls = {}
    for r in items:
        try:
            calls[r["id"]] = [[name, args] for c in bfcl.parse_tool_calls(r["text"]) for name, args in c.items()]
        except bfcl.ParseError:
            calls[r["id"]] = []
    return {"wall_s": wall, "tokens": sum(r["generated_tokens"] for r in items), "failed": 0, "calls": calls}


def _rate(side: dict) -> float:
    return side["tokens"] / side["wall_s"]


def compare_entrypoints(llm, cfg, repeats: int) -> dict:
    """The items of `cfg` (its categories' samples) through both paths with `llm`'s engine: a warm-up round, then
    `repeats` timed rounds, interleaved. -> medians, the per-round sides, and the calls of the last round."""
    items = [it for c in cfg.categories for it in cfg.sample(c)]
    policies = {"pask": llm.policy} if llm.policy is not None else {}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats + 1):  # round 0: the warm-up
            run = _run_side(llm, items, cfg.max_new_tokens, Path(tmp), str(r))
            harness = _bfcl_side(llm, cfg, policies)
            rounds.append({"run": run, "bfcl": harness})
            print(f"round {r}: run {_rate(run):.2f} tokens/s, bfcl {_rate(harness):.2f} tokens/s", flush=True)
    timed = rounds[1:]
    run_rates = sorted(_rate(x["run"]) for x in timed)
    bfcl_rates = sorted(_rate(x["bfcl"]) for x in timed)
    last = rounds[-1]

    def without_calls(side: dict) -> dict:
        return {k: v for k, v in side.items() if k != "calls"}

    result = {
        "benchmark": "entrypoints",
        "item_ids": [it["id"] for it in items],
        "warmup": {side: without_calls(rounds[0][side]) for side in ("run", "bfcl")},
        "timed": [{side: without_calls(x[side]) for side in ("run", "bfcl")} for x in timed],
        "run_tokens_per_s": run_rates[len(run_rates) // 2],
        "bfcl_tokens_per_s": bfcl_rates[len(bfcl_rates) // 2],
        "same_calls": sum(last["run"]["calls"].get(it["id"]) == last["bfcl"]["calls"].get(it["id"]) for it in items),
        "items": len(items),
        "calls": {side: last[side]["calls"] for side in ("run", "bfcl")},
    }
    result["run_over_bfcl"] = result["run_tokens_per_s"] / result["bfcl_tokens_per_s"]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="pask-jax bench entrypoints", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--method", default="pask")
    parser.add_argument("--budget", type=float, default=0.33)
    parser.add_argument(
        "--policy",
        default=AUTO_POLICY,
        help="for pask, as `pask-jax run` takes it: auto (the shipped one), a policy directory, or none (uncalibrated)",
    )
    parser.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/bench_entrypoints.json"))
    args = parser.parse_args(argv)
    categories = tuple(c for c in args.categories.split(",") if c)
    unknown = sorted(set(categories) - set(bfcl.CATEGORIES))
    if unknown or args.per_category < 1 or args.repeats < 1:
        parser.error(f"unknown categories {unknown}" if unknown else "--per-category and --repeats must be >= 1")

    from pask_jax.experiments.bfcl.evaluate import EvalConfig
    from pask_jax.llm import LLM

    llm = LLM(
        args.model, method=args.method, budget=args.budget, policy=policy_spec(args.policy), max_batch=args.batch_size
    )
    llm.engine  # noqa: B018  (loads the model before any timing)
    cfg = EvalConfig(
        methods=(args.method,),
        budgets=(llm.budget,),
        categories=categories,
        limit=args.per_category,
        split="dev",
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    result = compare_entrypoints(llm, cfg, args.repeats)
    result["machine"] = machine_info()
    result["config"] = vars(args) | {"out": str(args.out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"run {result['run_tokens_per_s']:.2f} tokens/s, bfcl {result['bfcl_tokens_per_s']:.2f} tokens/s "
        f"(run/bfcl {result['run_over_bfcl']:.2f}); same calls on {result['same_calls']} of {result['items']} items "
        f"-> {args.out}"
    )
    return result

"""Prefill speed and memory of the same prompts on several checkouts of this repository, side by side in one run.

    python scripts/bench_prefill_commits.py --checkout before=/tmp/before --checkout after=. \
        [--prompt-tokens 8192,16384] [--methods full,h2o] --out results/bench_prefill_commits.json

Each checkout runs in its own process (`PYTHONPATH` = the checkout, the same virtual environment), with that
checkout's engine defaults, through the API every version has: `LLM(model, method="full").model`, `make_engine`,
`Engine.batch_shape` / `capacities` / `prefill`. Per (length, method): the first prefill call (compile and run) and a
second, timed, call on the same random prompt of exactly that many tokens (batch 1, a seeded draw from the
vocabulary), and the process's peak resident memory over what was resident before the first call (Linux `VmHWM`,
reset through /proc/self/clear_refs). The checkouts take turns per row, so load on the machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pask_jax.experiments.bench.machine import write_result

CHILD = r"""
import json, sys, time
from pathlib import Path
import jax, numpy as np
from pask_jax.factory import make_engine
from pask_jax.llm import LLM

def rss(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024

model_name, method, budget, prompt_tokens = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
model = LLM(model_name, method="full").model
engine = make_engine(model, method, 1.0 if method == "full" else budget)
tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, prompt_tokens), dtype=np.int32)
lengths, roles = np.full(1, prompt_tokens, np.int32), np.zeros_like(tokens)
capacities = engine.capacities(engine.batch_shape([prompt_tokens], 64).prompt_bucket, 64)
Path("/proc/self/clear_refs").write_text("5")
start_rss = rss("VmRSS")
seconds = []
for _ in range(2):
    start = time.perf_counter()
    jax.block_until_ready(engine.prefill(tokens, lengths, roles, capacities))
    seconds.append(time.perf_counter() - start)
print(json.dumps({
    "first_call_s": round(seconds[0], 3), "prefill_s": round(seconds[1], 3),
    "tokens_per_s": round(prompt_tokens / seconds[1], 1),
    "rss_start_mib": round(start_rss, 1), "peak_rss_over_start_mib": round(rss("VmHWM") - start_rss, 1),
}))
"""


def commit_of(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def measure(checkout: Path, model: str, method: str, budget: float, prompt_tokens: int) -> dict:
    env = os.environ | {"PYTHONPATH": str(checkout.resolve())}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, method, str(budget), str(prompt_tokens)],
        env=env,
        capture_output=True,
        text=True,
        cwd=checkout,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", action="append", required=True, help="LABEL=DIR: a checkout of this repository")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--methods", default="full,h2o")
    p.add_argument("--budget", type=float, default=0.33)
    p.add_argument("--prompt-tokens", default="8192,16384")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    checkouts = {}
    for entry in args.checkout:
        label, _, path = entry.partition("=")
        checkouts[label] = {"path": path, "commit": commit_of(Path(path))}
    result = {"benchmark": "prefill_commits", "model": args.model, "budget": args.budget, "checkouts": checkouts}
    result["rows"] = []
    for prompt_tokens in (int(n) for n in args.prompt_tokens.split(",")):
        for method in args.methods.split(","):
            row = {"method": method, "prompt_tokens": prompt_tokens}
            for label, checkout in checkouts.items():
                row[label] = measure(Path(checkout["path"]), args.model, method, args.budget, prompt_tokens)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            write_result(args.out, result)  # after every row: a stopped run keeps it


if __name__ == "__main__":
    main()

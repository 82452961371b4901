"""The tables of docs/results/parity.md: real-model parity with transformers' own GGUF load, both models."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from tools.report.common import _block, _table, load_json


def real_parity(root: Path, file: str = "results/real_parity.json") -> str:
    result = load_json(root, file)
    rows = [[i["id"], "yes" if i["identical"] else "no", i["first_divergence"] or "-"] for i in result["items"]]
    claim = (
        f"{result['model']} (GGUF): our engine and transformers' own GGUF load give identical greedy "
        f"{result['tokens']}-token outputs on {result['identical']} of {result['n']} BFCL prompts; the last prompt "
        f"token's logits differ by at most {result['max_abs_logit_diff_last_prompt_token']:.1e}."
    )
    return _block(claim, _table(["item", "identical", "first divergence"], rows))


TABLES: dict[str, Callable[[Path], str]] = {
    "real_parity": real_parity,
    "real_parity_1_5b": functools.partial(real_parity, file="results/real_parity_qwen2.5-coder-1.5b.json"),
}

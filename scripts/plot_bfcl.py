"""Plot BFCL accuracy (8-category mean) against the KV budget, one line per method, from `pask-jax bfcl` JSON files.

python scripts/plot_bfcl.py results/bfcl_*.json --out results/bfcl_accuracy_vs_budget.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--metric", default="overall", choices=["overall", "non_live", "live"])
    parser.add_argument("--out", type=Path, default=Path("results/bfcl_accuracy_vs_budget.png"))
    args = parser.parse_args()
    points: dict[str, dict[float, float]] = defaultdict(dict)
    model = ""
    for path in args.results:
        result = json.loads(path.read_text())
        model = result["model"]
        for s in result["summary"]:
            if s.get(args.metric) is not None:
                points[s["method"]][s["budget"]] = 100 * s[args.metric]
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, by_budget in sorted(points.items()):
        budgets = sorted(by_budget)
        if method == "full":
            ax.axhline(by_budget[budgets[-1]], color="black", linestyle="--", label="full KV")
            continue
        ax.plot(budgets, [by_budget[b] for b in budgets], marker="o", label=method)
    ax.set_xlabel("total KV budget b (kept / full)")
    ax.set_ylabel(f"BFCL accuracy, {args.metric} (%)")
    ax.set_title(f"{model}: accuracy vs KV budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Plot a `pask-jax niah` results JSON: depth x length heat maps per method, and accuracy against the KV budget.

python -m tools.plot_niah results/niah.json [--budget 0.03] [--haystack noise] [--mode free]

Writes beside the JSON:
- `<stem>_heatmap_b<budget>_<haystack>_<mode>.png` for each budget, haystack and answer mode in the file (or those
  asked for): one panel per method at that budget (full KV in each), the needle's depth down, the prompt length
  across, each square the fraction of its cells answered correctly;
- `<stem>_accuracy_vs_budget.png`: one panel per haystack x mode, accuracy over every length and depth against the
  budget, one line per method, full KV dashed.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _methods(cells: list[dict]) -> list[str]:
    return list(dict.fromkeys(c["method"] for c in cells))


def heatmap_figure(cells: list[dict], budget: float, haystack: str, mode: str, model: str) -> plt.Figure:
    """One panel per method: accuracy per (depth, length) at `budget` (full KV at its own budget, 1)."""
    mine = [
        c
        for c in cells
        if (c["haystack"], c["mode"]) == (haystack, mode) and (c["budget"] == budget or c["method"] == "full")
    ]
    depths = sorted({c["depth"] for c in mine})
    lengths = sorted({c["length"] for c in mine})
    methods = _methods(mine)
    fig, axes = plt.subplots(
        1, len(methods), figsize=(1.6 + 1.6 * len(methods), 4.2), squeeze=False, sharey=True, layout="constrained"
    )
    image = None
    for ax, method in zip(axes[0], methods, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                scored = [
                    c["correct"] for c in mine if (c["method"], c["depth"], c["length"]) == (method, depth, length)
                ]
                if scored:
                    grid[i, j] = np.mean(scored)
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{method}\n{np.nanmean(grid):.0%}", fontsize=9)
        ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
        ax.set_xlabel("prompt tokens", fontsize=8)
    axes[0][0].set_ylabel("needle depth (% of haystack)")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="correct")
    fig.suptitle(f"{model}: needle in a haystack ({haystack}, {mode} answers), KV budget {budget:g}", fontsize=10)
    return fig


def budget_figure(cells: list[dict], model: str) -> plt.Figure:
    """Accuracy over all lengths and depths against the budget, one panel per (haystack, mode)."""
    panels = list(dict.fromkeys((c["haystack"], c["mode"]) for c in cells))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (haystack, mode) in zip(axes[0], panels, strict=True):
        scored: dict[str, dict[float, list[bool]]] = defaultdict(lambda: defaultdict(list))
        for c in cells:
            if (c["haystack"], c["mode"]) == (haystack, mode):
                scored[c["method"]][c["budget"]].append(c["correct"])
        budgets = sorted({b for method, by in scored.items() if method != "full" for b in by})
        for method in _methods(cells):
            by_budget = scored.get(method)
            if not by_budget:
                continue
            if method == "full":
                ax.axhline(100 * np.mean(by_budget[1.0]), color="black", linestyle="--", label="full KV")
                continue
            xs = sorted(by_budget)
            ax.plot(xs, [100 * np.mean(by_budget[b]) for b in xs], marker="o", label=method)
        ax.set_xscale("log")
        if budgets:
            ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
            ax.minorticks_off()
        ax.set_ylim(-3, 103)
        ax.set_xlabel("total KV budget b (kept / full)")
        ax.set_title(f"{haystack} haystack, {mode} answers", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("needle retrieved (%)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{model}: needle in a haystack accuracy vs KV budget", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a `pask-jax niah --out` JSON")
    parser.add_argument("--budget", type=float, action="append", help="heat maps at this budget only (repeatable)")
    parser.add_argument("--haystack", action="append", help="heat maps of this haystack only (repeatable)")
    parser.add_argument("--mode", action="append", help="heat maps of this answer mode only (repeatable)")
    args = parser.parse_args(argv)
    result = json.loads(args.results.read_text())
    cells, model = result["cells"], result["model"]
    if not cells:
        parser.error(f"{args.results} has no cells yet")
    budgets = sorted({c["budget"] for c in cells if c["method"] != "full"}) or [1.0]
    written = []
    for budget in args.budget or budgets:
        for haystack in args.haystack or dict.fromkeys(c["haystack"] for c in cells):
            for mode in args.mode or dict.fromkeys(c["mode"] for c in cells):
                if not any((c["budget"], c["haystack"], c["mode"]) == (budget, haystack, mode) for c in cells):
                    continue
                fig = heatmap_figure(cells, budget, haystack, mode, model)
                written.append(args.results.with_name(f"{args.results.stem}_heatmap_b{budget:g}_{haystack}_{mode}.png"))
                fig.savefig(written[-1], dpi=120)
                plt.close(fig)
    fig = budget_figure(cells, model)
    written.append(args.results.with_name(f"{args.results.stem}_accuracy_vs_budget.png"))
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()

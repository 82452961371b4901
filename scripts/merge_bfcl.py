"""Merge `pask-jax bfcl` results over disjoint item ranges (e.g. `--offset 0 --limit 8` and `--offset 8 --limit 17`)
into one result, as if run at once: items concatenated per (method, budget, category), counts and means recomputed.
With `--replace`, a later result's items replace an earlier result's items of the same id (a rerun after a fix).
`PATH#OLD=NEW` renames method OLD in that file (two PASK policies that both ran as `pask`, side by side).

    python scripts/merge_bfcl.py results/a.json results/b.json --out results/merged.json [--methods full] [--replace]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pask_jax.experiments.bfcl.evaluate import format_table
from pask_jax.experiments.bfcl.merge import load, merge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="result files, each optionally PATH#OLD=NEW (rename a method)")
    parser.add_argument("--methods", help="comma-separated method specs to keep (default: all)")
    parser.add_argument("--replace", action="store_true", help="later results replace items of the same id")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    methods = set(args.methods.split(",")) if args.methods else None
    merged = merge([load(arg) for arg in args.results], methods, args.replace)
    args.out.write_text(json.dumps(merged, indent=1) + "\n")
    categories = list(dict.fromkeys(r["category"] for r in merged["runs"]))
    print(format_table(merged, categories))


if __name__ == "__main__":
    main()

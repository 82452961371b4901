"""Write the tables of docs/RESULTS.md from the committed results files, or check that they match them.

    python scripts/results_tables.py            # rewrite every `<!-- table:NAME -->` block of docs/RESULTS.md
    python scripts/results_tables.py --check    # exit 1, naming the stale tables, if any block differs

The tables are defined in `pask_jax.report`; the text around the blocks is left as it is.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from pask_jax.report import TABLES, ReportError, render_tables, stale_tables, table_blocks

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "RESULTS.md", help="the document to fill or check")
    parser.add_argument("--root", type=Path, default=REPO, help="repository root the results paths are relative to")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if any table is stale")
    args = parser.parse_args(argv)
    doc = args.doc.read_text(encoding="utf-8")
    try:
        if not args.check:
            args.doc.write_text(render_tables(doc, args.root), encoding="utf-8")
            print(f"wrote {len(table_blocks(doc))} tables into {args.doc}")
            return 0
        stale = stale_tables(doc, args.root)
    except ReportError as e:
        print(f"results_tables: error: {e}", file=sys.stderr)
        return 2
    blocks = table_blocks(doc)
    for name in stale:
        print(f"stale: {name}")
        if name in blocks:
            expected = TABLES[name](args.root) + "\n"
            diff = difflib.unified_diff(
                blocks[name].splitlines(), expected.splitlines(), "document", "results", lineterm=""
            )
            print("\n".join(diff))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

"""Write the tables of the results documents from the committed results files, or check that they match them.

    python -m tools.results_tables            # rewrite every `<!-- table:NAME -->` block of docs/results/*.md and
                                              # the README
    python -m tools.results_tables --check    # exit 1, naming the stale tables, if any block differs

The tables are defined in `tools.report`; each lives in one of the documents, and the text around the blocks is left
as it is. `--doc FILE` (repeatable) works on those documents instead.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from tools.report import TABLES, ReportError, render_tables, stale_in_documents, table_blocks

REPO = Path(__file__).resolve().parents[1]  # run from the repository root: `python -m tools.results_tables`
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs" / "results").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", type=Path, action="append", help="a document to fill or check (repeatable)")
    parser.add_argument("--root", type=Path, default=REPO, help="repository root the results paths are relative to")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if any table is stale")
    args = parser.parse_args(argv)
    paths = args.doc or DOCUMENTS
    docs = {str(path): path.read_text(encoding="utf-8") for path in paths}
    try:
        if not args.check:
            for path in paths:
                path.write_text(render_tables(docs[str(path)], args.root), encoding="utf-8")
                print(f"wrote {len(table_blocks(docs[str(path)]))} tables into {path}")
            return 0
        stale = stale_in_documents(docs, args.root)
    except ReportError as e:
        print(f"results_tables: error: {e}", file=sys.stderr)
        return 2
    for entry in stale:
        print(f"stale: {entry}")
        doc_name, _, name = entry.partition(": ")
        if name:
            expected = TABLES[name](args.root) + "\n"
            diff = difflib.unified_diff(
                table_blocks(docs[doc_name])[name].splitlines(),
                expected.splitlines(),
                "document",
                "results",
                lineterm="",
            )
            print("\n".join(diff))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

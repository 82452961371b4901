"""The tables of the results documents (docs/results/*.md and the README), computed from the committed results
files, and paired statistics for two methods scored on the same items.

A table sits in the document between ``<!-- table:NAME -->`` and ``<!-- /table -->``; ``TABLES`` maps every NAME
to the function that renders it (a claim sentence with its numbers, then a Markdown table) from the files under the
repository root. ``render_tables`` rewrites every block from its files and leaves the text around the blocks as it
is; ``stale_tables`` names the blocks whose text differs from what their files give (what
``python -m tools.results_tables --check`` reports).

A document's tables live in the module named after it, each with its ``TABLES``: ``archive``, ``bfcl``, ``demo``,
``long_prompts_doc`` (the package's ``long_prompts`` is the table function of ``frozen``), ``niah``, ``parity``,
``quantized``, ``schemas``, ``second_model`` and ``serving`` for docs/results/, ``readme`` for the README. They
share ``common`` (reading results files, formatting), ``stats`` and ``frozen`` (the schema split's methods, tuned on
dev and frozen, that several documents report).

Paired statistics over items (``stats``): ``paired_bootstrap_ci`` (percentile interval of an accuracy difference,
items resampled with replacement, fixed seed) and ``mcnemar_exact_p`` (two-sided exact binomial test on the discordant
items). Standard library only, plus ``experiments.bfcl`` (the split rule, BFCL's means, the items' tool sets; it loads
no JAX), for one table the role names of ``pask_jax.structure.roles`` and for another ``jsonschema``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tools.report import (
    archive,
    bfcl,
    demo,
    long_prompts_doc,
    niah,
    parity,
    quantized,
    readme,
    schemas,
    second_model,
    serving,
)
from tools.report.common import ReportError
from tools.report.frozen import Tuning, dev_tuning, long_prompts
from tools.report.long_prompts_doc import dev_held_out
from tools.report.niah import leading_digits_right
from tools.report.stats import mcnemar_exact_p, paired_bootstrap_ci

__all__ = [  # what tools/results_tables.py and the tests import
    "TABLES",
    "ReportError",
    "Tuning",
    "dev_held_out",
    "dev_tuning",
    "leading_digits_right",
    "long_prompts",
    "mcnemar_exact_p",
    "paired_bootstrap_ci",
    "render_tables",
    "stale_in_documents",
    "stale_tables",
    "table_blocks",
]


CLOSING = "<!-- /table -->"
# Markers are whole lines, so a document may quote them inline.
BLOCK = re.compile(r"^<!-- table:([a-z0-9_]+) -->\n(.*?)^<!-- /table -->$", re.DOTALL | re.MULTILINE)
MARKER_LINE = re.compile(r"^<!-- /?table.*$", re.MULTILINE)

TABLES: dict[str, Callable[[Path], str]] = {  # every document's, the README's first, then docs/results/ by name
    **readme.TABLES,
    **archive.TABLES,
    **bfcl.TABLES,
    **demo.TABLES,
    **long_prompts_doc.TABLES,
    **niah.TABLES,
    **parity.TABLES,
    **quantized.TABLES,
    **schemas.TABLES,
    **second_model.TABLES,
    **serving.TABLES,
}


# ---- the document ---------------------------------------------------------------------------------------------------


def table_blocks(doc: str) -> dict[str, str]:
    """NAME -> the text between a block's markers, checked: every opening marker closed, names known and unique."""
    blocks = {}
    for match in BLOCK.finditer(doc):
        name = match.group(1)
        if name not in TABLES:
            raise ReportError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        if name in blocks:
            raise ReportError(f"table {name!r} appears twice")
        blocks[name] = match.group(2)
    if len(MARKER_LINE.findall(doc)) != 2 * len(blocks):
        raise ReportError(f"unbalanced or malformed table markers (each block: `<!-- table:NAME -->` ... `{CLOSING}`)")
    return blocks


def render_tables(doc: str, root: Path) -> str:
    """`doc` with every table block rewritten from its results files; the text outside the blocks is kept."""
    table_blocks(doc)
    return BLOCK.sub(lambda m: f"<!-- table:{m.group(1)} -->\n{TABLES[m.group(1)](root)}\n{CLOSING}", doc)


def stale_tables(doc: str, root: Path, *, every_table: bool = True) -> list[str]:
    """Names of the blocks whose text differs from what their files give, then (with `every_table`) of the known
    tables `doc` lacks."""
    blocks = table_blocks(doc)
    stale = [name for name, text in blocks.items() if text != TABLES[name](root) + "\n"]
    return stale + ([f"{name} (missing)" for name in TABLES if name not in blocks] if every_table else [])


def stale_in_documents(docs: dict[str, str], root: Path) -> list[str]:
    """`stale_tables` over several documents (name -> text) that share the tables between them: each block checked
    where it stands, a table in two documents an error, one in none reported missing."""
    where: dict[str, str] = {}
    stale = []
    for doc_name, text in docs.items():
        for name in table_blocks(text):
            if name in where:
                raise ReportError(f"table {name!r} appears in both {where[name]} and {doc_name}")
            where[name] = doc_name
        stale += [f"{doc_name}: {name}" for name in stale_tables(text, root, every_table=False)]
    return stale + [f"{name} (missing)" for name in TABLES if name not in where]

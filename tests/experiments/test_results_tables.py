"""The results documents' generated tables against the committed results files, and the paired statistics."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tools import report
from tools.report import (
    ReportError,
    mcnemar_exact_p,
    paired_bootstrap_ci,
    render_tables,
    stale_in_documents,
    stale_tables,
)

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs" / "results").glob("*.md"))]
ARCHIVE = REPO / "docs" / "results" / "archive.md"
needs_bfcl_data = pytest.mark.skipif(
    importlib.util.find_spec("bfcl_eval") is None, reason="the overlap tables read BFCL's tool sets"
)


# ---- the document ---------------------------------------------------------------------------------------------------


@needs_bfcl_data
def test_every_table_matches_its_results_file():
    assert stale_in_documents({str(p): p.read_text(encoding="utf-8") for p in DOCS}, REPO) == []


@needs_bfcl_data
def test_a_changed_cell_is_reported(tmp_path: Path):
    doc = ARCHIVE.read_text(encoding="utf-8")
    row = "| pask | 0.33 | 88 | 64 |"
    assert doc.count(row) == 1
    changed = tmp_path / "archive.md"
    changed.write_text(doc.replace(row, "| pask | 0.33 | 88 | 68 |"), encoding="utf-8")
    assert stale_tables(changed.read_text(encoding="utf-8"), REPO, every_table=False) == ["bfcl_sweep_25"]
    check = [sys.executable, "-m", "tools.results_tables", "--check", "--doc", str(changed)]
    run = subprocess.run(check, capture_output=True, text=True, cwd=REPO)
    assert (
        run.returncode == 1
        and f"stale: {changed}: bfcl_sweep_25" in run.stdout
        and "+| pask | 0.33 | 88 | 64 |" in run.stdout
    )


def test_render_rewrites_blocks_and_keeps_the_text_around(tmp_path: Path):
    (tmp_path / "results").mkdir()
    rows = [{"budget": 1.0, "bytes": 400, "ratio_vs_full": 1.0}, {"budget": 0.5, "bytes": 200, "ratio_vs_full": 0.5}]
    args = {"model": "m", "prompt_len": "8", "new_tokens": "2", "batch": "1"}
    (tmp_path / "results" / "cache_bytes.json").write_text(json.dumps({"args": args, "rows": rows}))
    before = "# Title\n\nhand text quoting `<!-- table:cache_bytes -->`\n\n"
    doc = before + "<!-- table:cache_bytes -->\nSTALE TEXT\n<!-- /table -->\n\nafter\n"
    rendered = render_tables(doc, tmp_path)
    assert rendered.startswith(before + "<!-- table:cache_bytes -->\n**Claim.**")
    assert rendered.endswith("| 0.5 | 0.0 | 0.5000 |\n<!-- /table -->\n\nafter\n") and "STALE TEXT" not in rendered
    assert "0.5000 of full KV's bytes at b = 1 / 0.5" in rendered
    missing = [f"{name} (missing)" for name in report.TABLES if name != "cache_bytes"]
    assert stale_tables(rendered, tmp_path) == missing
    assert stale_tables(doc, tmp_path) == ["cache_bytes", *missing]
    assert stale_in_documents({"a.md": rendered, "b.md": "text\n"}, tmp_path) == missing
    with pytest.raises(ReportError, match="appears in both a.md and b.md"):
        stale_in_documents({"a.md": rendered, "b.md": rendered}, tmp_path)


@pytest.mark.parametrize(
    "doc, message",
    [
        ("<!-- table:nonsense -->\nx\n<!-- /table -->\n", "unknown table 'nonsense'"),
        ("<!-- table:cache_bytes -->\nx\n", "unbalanced"),
        ("<!-- table:cache_bytes -->\n<!-- /table -->\n<!-- table:cache_bytes -->\n<!-- /table -->\n", "twice"),
    ],
)
def test_malformed_documents_are_refused(doc: str, message: str, tmp_path: Path):
    with pytest.raises(ReportError, match=message):
        stale_tables(doc, tmp_path)


def test_a_missing_results_file_is_named(tmp_path: Path):
    with pytest.raises(ReportError, match="results/cache_bytes.json is missing"):
        render_tables("<!-- table:cache_bytes -->\n<!-- /table -->\n", tmp_path)
    interrupted = tmp_path / "results/bfcl_schema_eval.json"
    interrupted.parent.mkdir()
    interrupted.write_text(json.dumps({"runs": [], "partial": {"category": "multiple"}}))
    with pytest.raises(ReportError, match="has multiple under way"):
        render_tables("<!-- table:schema_eval -->\n<!-- /table -->\n", tmp_path)


def _bfcl_ids(split: str, offset: int = 0) -> list[str]:
    from pask_jax.experiments import bfcl

    sample = bfcl.dev_sample if split == "dev" else bfcl.evaluation_sample
    return [i["id"] for i in sample("simple_python", offset, 3)]


def _write_bfcl_result(
    root: Path,
    name: str,
    split: str,
    layout: str,
    right: dict[str, list[str]],
    method_config: dict | None = None,
    offset: int = 0,
) -> str:
    """A `pask-jax bfcl` result over 3 simple_python items of `split` from `offset`: spec -> the ids it got right,
    b = 0.2."""
    ids = _bfcl_ids(split, offset)
    runs = [
        {"method": spec, "budget": 1.0 if spec == "full" else 0.2, "category": "simple_python", "prepare_s": 1.0}
        | {"items": [{"id": i, "valid": i in ok, "prompt_tokens": 9, "error_type": None} for i in ids], "n": 3}
        for spec, ok in right.items()
    ]
    config = {"split": split, "layout": layout, "context": 16, "method_config": method_config or {}, "policies": {}}
    (root / name).write_text(json.dumps({"config": config, "runs": runs}))
    return name


@needs_bfcl_data
def test_variants_are_chosen_over_every_dev_file_and_evaluation_rows_held_to_the_choice(tmp_path: Path):
    dev, held_out = _bfcl_ids("dev"), _bfcl_ids("evaluation")

    def write(name: str, split: str, layout: str, right: dict[str, list[str]]) -> str:
        return _write_bfcl_result(tmp_path, name, split, layout, right)

    # snapkv:w8 wins the first file 2-1, the default the second 2-0: over both, the default (3 against 2)
    files = (
        write("a.json", "dev", "question_last", {"full": dev, "snapkv": dev[:1], "snapkv:w8": dev[:2], "pask": []}),
        write("b.json", "dev", "question_first", {"full": dev, "snapkv": dev[:2], "snapkv:w8": [], "pask": []}),
    )
    tuning = report.Tuning(files, 0.2)
    table = report.dev_tuning(tmp_path, tuning)
    assert "| snapkv | - | 3/6 | 1/3 | 2/3 | 3/6 | **chosen** |" in table
    assert "| snapkv:w8 | - | 2/6 | 2/3 | 0/3 | 2/6 |  |" in table
    full = {"full": held_out, "pask": held_out[:1]}
    evaluation = write("e.json", "evaluation", "question_last", full | {"snapkv": held_out[:2], "snapkv:w8": []})
    with pytest.raises(ReportError, match=r"scores \['snapkv:w8'\], neither the dev rule's choice"):
        report.long_prompts(tmp_path, evaluation, tuning)
    evaluation = write("e.json", "evaluation", "question_last", full | {"snapkv": held_out[:2]})
    assert "| PASK vs snapkv, b = 0.2 | 3 | 1 | 2 | 0 | 1 |" in report.long_prompts(tmp_path, evaluation, tuning)
    write("b.json", "evaluation", "question_first", {"full": held_out, "snapkv": [], "snapkv:w8": [], "pask": []})
    with pytest.raises(ReportError, match="outside the schema split's dev part"):
        report.dev_tuning(tmp_path, tuning)


@needs_bfcl_data
def test_a_variant_run_in_later_dev_files_keeps_its_settings_and_layout_columns_sum_files(tmp_path: Path):
    dev = _bfcl_ids("dev")
    files = (
        _write_bfcl_result(tmp_path, "a.json", "dev", "question_last", {"snapkv": dev[:2]}, {"snapkv": {"window": 32}}),
        _write_bfcl_result(tmp_path, "b.json", "dev", "question_first", {"snapkv": dev[:1]}),
        _write_bfcl_result(
            tmp_path, "c.json", "dev", "question_last", {"snapkv:w16": dev}, {"snapkv:w16": {"window": 16}}
        ),
        _write_bfcl_result(tmp_path, "d.json", "dev", "question_first", {"snapkv:w16": dev[:1]}),
    )
    table = report.dev_tuning(tmp_path, report.Tuning(files, 0.2))
    assert "| variant | settings | simple_python | question last | question first | correct |  |" in table
    assert "| snapkv | window=32 | 3/6 | 2/3 | 1/3 | 3/6 |  |" in table
    assert "| snapkv:w16 | window=16 | 4/6 | 3/3 | 1/3 | 4/6 | **chosen** |" in table


@needs_bfcl_data
def test_held_out_dev_rows_add_both_parts_and_refuse_items_the_choices_read(tmp_path: Path):
    seen, new = _bfcl_ids("dev"), _bfcl_ids("dev", offset=3)

    def write(name: str, layout: str, right: dict[str, list[str]], offset: int) -> str:
        return _write_bfcl_result(tmp_path, name, "dev", layout, right, offset=offset)

    first = report.Tuning(
        (
            write("a.json", "question_last", {"full": seen, "snapkv": seen[:1], "pask": seen[:2]}, 0),
            write("b.json", "question_first", {"full": seen[:1], "snapkv": [], "pask": []}, 0),
        ),
        0.2,
    )
    held_out = (
        write("c.json", "question_last", {"full": new, "snapkv": new, "pask": new[:1]}, 3),
        write("d.json", "question_first", {"full": [], "snapkv": new[:1], "pask": new[:1]}, 3),
    )
    first_dev = {"full": first, "snapkv": first, "pask": first}
    table = report.dev_held_out(tmp_path, held_out, first_dev)
    assert "| snapkv | 1/3 | 3/3 | 0/3 | 1/3 | 4/6 | 5/12 |" in table
    assert "| pask | 2/3 | 1/3 | 0/3 | 1/3 | 2/6 | 4/12 |" in table
    assert "| PASK vs snapkv, items 8-19 | 6 | 2 | 4 | 0 | 2 |" in table
    assert "| PASK vs snapkv, items 0-19 | 12 | 4 | 5 | 1 | 2 |" in table
    write("d.json", "question_first", {"full": [], "snapkv": seen[:1], "pask": seen[:1]}, 0)
    with pytest.raises(ReportError, match="held-out items must be dev items the first dev files did not score"):
        report.dev_held_out(tmp_path, held_out, first_dev)


# ---- paired statistics ----------------------------------------------------------------------------------------------


def test_mcnemar_exact_p_by_hand():
    # b = 3, c = 9: n = 12, 2 * (C(12,0) + C(12,1) + C(12,2) + C(12,3)) / 2^12 = 2 * 299 / 4096
    assert mcnemar_exact_p(3, 9) == pytest.approx(598 / 4096) and round(mcnemar_exact_p(3, 9), 3) == 0.146
    assert mcnemar_exact_p(9, 3) == mcnemar_exact_p(3, 9)  # two-sided: symmetric
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)  # all 5 discordant items one way
    assert mcnemar_exact_p(8, 5) == pytest.approx(2 * (1 + 13 + 78 + 286 + 715 + 1287) / 2**13)  # 0.581
    assert mcnemar_exact_p(0, 0) == 1.0 and mcnemar_exact_p(4, 4) == 1.0  # capped at 1
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact_p(-1, 2)


def test_bootstrap_interval_by_hand():
    # d = [1, 0, 0, 0, 0]: the resampled mean is k / 5 with k ~ Binomial(5, 0.2); P(k = 0) = 0.33 > 2.5%, so the
    # lower end is 0; P(k <= 2) = 0.942 < 97.5% < P(k <= 3) = 0.993, so the upper end is 3 / 5.
    a, b = [True, False, False, False, False], [False] * 5
    assert paired_bootstrap_ci(a, b) == (0.0, 0.6)
    assert paired_bootstrap_ci(b, a) == (-0.6, 0.0)
    # two items, d = [1, 0]: the mean is 0 / 0.5 / 1 with probabilities 1/4, 1/2, 1/4: both ends are reached
    assert paired_bootstrap_ci([True, True], [False, True]) == (0.0, 1.0)
    assert paired_bootstrap_ci([True, False] * 20, [True, False] * 20) == (0.0, 0.0)  # identical outcomes
    assert paired_bootstrap_ci([True] * 7, [False] * 7) == (1.0, 1.0)


def test_bootstrap_is_seeded_and_covers_the_observed_difference():
    a = [i % 3 != 0 for i in range(60)]
    b = [i % 4 != 0 for i in range(60)]
    low, high = paired_bootstrap_ci(a, b)
    assert paired_bootstrap_ci(a, b) == (low, high) and low < (sum(a) - sum(b)) / 60 < high
    other_seed = paired_bootstrap_ci(a, b, seed=1)
    assert all(abs(x - y) <= 2 / 60 for x, y in zip(other_seed, (low, high), strict=True))  # resampling noise
    narrow = paired_bootstrap_ci(a, b, level=0.5)
    assert low <= narrow[0] <= narrow[1] <= high and not math.isclose(narrow[0], low)
    for bad in ((a, b[:-1]), ([], [])):
        with pytest.raises(ValueError, match="equally long"):
            paired_bootstrap_ci(*bad)
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap_ci(a, b, level=1.0)


def test_leading_digits_right_stops_at_the_first_wrong_digit():
    assert report.leading_digits_right("4229659", "4229422") == 4  # the NIAH slips: the number's start kept
    assert report.leading_digits_right("4229659", "4229659") == 7
    assert report.leading_digits_right("4229659", "42") == 2 and report.leading_digits_right("4229659", None) == 0
    assert report.leading_digits_right("4229659", "1234567") == 0

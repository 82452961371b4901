"""The command line: what it lists, that it loads no JAX for light commands, and clear errors before any work."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pask_jax import cli
from pask_jax.methods import METHODS


def test_method_choices_are_the_registered_methods():
    assert sorted(cli.METHOD_NAMES) == sorted(METHODS)  # the CLI keeps its own copy to stay JAX-free


def test_help_and_fetch_model_load_no_jax():
    code = "import json, sys, pask_jax.cli; print(json.dumps([m for m in ('jax', 'flax') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_run_reports_a_missing_input_and_bad_budget(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert exit_info.value.code != 0
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "-i", "x", "-o", "y", "--method", "magic"])
    assert exit_info.value.code == 2 and "magic" in capsys.readouterr().err


def test_run_exit_status_counts_failed_lines(tmp_path: Path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text("{not json\n")
    with pytest.raises(SystemExit) as exit_info:  # nothing to run: no model is loaded, and the line failed
        cli.main(["run", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", "no-such-model"])
    assert exit_info.value.code == 1
    assert "1 failed" in capsys.readouterr().err.splitlines()[-1]


def test_run_takes_a_labelled_variant_and_names_a_missing_one(tmp_path: Path, capsys):
    args = argparse.Namespace(method="pask:dapq_tier_request", method_config=None, budget=0.2, policy="auto")
    options = cli._llm_options(args)
    assert options["method"] == "pask" and options["policy"] == "auto"
    assert options["method_overrides"] == {"sinks": 1, "rank": "dapq_tier", "system_as_user": True}
    args.method = "snapkv"
    assert cli._llm_options(args)["method_overrides"] is None  # no variant, no config file: the method's defaults
    with pytest.raises(
        SystemExit, match="'pask:nope': a label must name .* the config's pask variants: pask:dapq_rank"
    ):
        cli.main(["run", "-i", "x", "-o", str(tmp_path / "o.jsonl"), "--method", "pask:nope", "--model", "no-such"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "-i", "x", "-o", "y", "--method", "magic:w8"])
    assert exit_info.value.code == 2 and "unknown method 'magic:w8'" in capsys.readouterr().err

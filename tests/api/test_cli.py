"""The command line: what it lists, that it loads no JAX for light commands, and clear errors before any work."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pask_jax import arguments, cli
from pask_jax.methods import METHODS

REQUEST = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """Every way a command reaches a model (its path, config, tokenizer or weights) fails the test: bad command lines
    must be refused before any of them, and these tests never load a model."""
    import pask_jax
    import pask_jax.experiments.bfcl.evaluate
    import pask_jax.experiments.niah  # noqa: F401  (imported so its bindings are replaced too)
    import pask_jax.llm

    def refuse(*args, **kwargs):
        raise AssertionError("a model was reached before the command line was checked")

    names = ("LLM", "load_model", "load_tokenizer", "load_tokenizer_from_path", "load_config", "resolve_model_path")
    for name, module in list(sys.modules.items()):
        if name == "pask_jax" or name.startswith("pask_jax."):
            for attr in names:
                if attr in vars(module):
                    monkeypatch.setattr(module, attr, refuse)
    for attr in ("LLM", "load_model", "load_tokenizer", "resolve_model_path"):  # the package's lazy exports
        monkeypatch.setattr(pask_jax, attr, refuse, raising=False)


def usage_error(argv: list[str], capsys) -> str:
    """The one stderr line of a refused command line (exit status 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"pask-jax {argv[0]}: error: "), err
    assert "Traceback" not in err
    return err


@pytest.fixture
def requests_file(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(REQUEST) + "\n")
    return path


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    """A directory the front door takes for a policy (it checks for policy.json only; nothing loads it here)."""
    path = tmp_path / "policy"
    path.mkdir()
    (path / "policy.json").write_text("{}")
    return path


def test_method_choices_are_the_registered_methods():
    assert sorted(arguments.METHOD_NAMES) == sorted(METHODS)  # the front door keeps its own copy to stay JAX-free


def test_front_door_file_names_are_the_policy_modules():
    from pask_jax.policy import STATS_FILE

    assert arguments.STATS_FILE == STATS_FILE and arguments.POLICY_META == "policy.json"


def test_front_door_grammar_cache_words_are_the_cache_modules():
    from pask_jax.structure import grammar_cache

    assert arguments.GRAMMAR_CACHE_OFF == grammar_cache.OFF  # kept apart: the front door imports no JAX


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
    args = argparse.Namespace(method="pask:v1", method_config=None, budget=0.2, policy="auto")
    options = cli._llm_options(args)
    assert options["method"] == "pask" and options["policy"] == "auto"
    assert options["method_overrides"] == {"rank": "recency", "system_as_request": False}  # the variant alone
    args.method = "snapkv"
    assert cli._llm_options(args)["method_overrides"] is None  # no variant, no config file: the method's defaults
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(REQUEST) + "\n")
    err = usage_error(["run", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--method", "pask:nope"], capsys)
    assert re.search("'pask:nope': a label must name .* the config's pask variants: pask:v1", err)
    err = usage_error(["run", "-i", "x", "-o", "y", "--method", "magic:w8"], capsys)
    assert "argument --method: unknown method 'magic:w8'" in err


# ---- the front door: each kind of bad input is one line naming the argument, exit status 2, before any model ----


def test_run_refuses_bad_paths_and_settings_before_the_model(tmp_path: Path, requests_file: Path, capsys):
    out = str(tmp_path / "out.jsonl")
    run = ["run", "-i", str(requests_file), "-o", out]
    cases = {
        "-i/--input": ["run", "-i", str(tmp_path / "missing.jsonl"), "-o", out],
        "a directory, not an input file": ["run", "-i", str(tmp_path), "-o", out],
        "directory /pask-jax-no-such-root-dir does not exist": [
            "run",
            "-i",
            str(requests_file),
            "-o",
            "/pask-jax-no-such-root-dir/out.jsonl",
        ],
        "-o/--output": ["run", "-i", str(requests_file), "-o", str(tmp_path)],
        "must not be the input file": ["run", "-i", str(requests_file), "-o", str(requests_file)],
        "--policy: no such policy directory": [*run, "--policy", str(tmp_path / "no-policy")],
        "holds no policy (no policy.json)": [*run, "--policy", str(tmp_path)],
        "argument --budget": [*run, "--budget", "1.5"],
        "argument --budget: budget 0 must be in (0, 1]": [*run, "--budget", "0"],
        "argument --max-batch": [*run, "--max-batch", "0"],
        "argument --prefill-rows": [*run, "--prefill-rows", "-1"],
        "argument --prefill-chunk": [*run, "--prefill-chunk", "0"],
        "argument --kv-memory-mb": [*run, "--kv-memory-mb", "0"],
        "--method-config": [*run, "--method-config", str(tmp_path / "missing.toml")],
        "argument --grammar-backend: unknown grammar backend 'xgrammar'": [*run, "--grammar-backend", "xgrammar"],
        "--grammar-cache": [*run, "--grammar-cache", str(requests_file)],
    }
    for named, argv in cases.items():
        assert named in usage_error(argv, capsys), argv
    assert not Path("/pask-jax-no-such-root-dir").exists() and not Path(out).exists()


@pytest.mark.parametrize("given", [None, "DIR", "none"])
def test_run_grammar_cache_reaches_the_llm(tmp_path: Path, requests_file: Path, monkeypatch, given):
    import pask_jax.llm

    class Built(Exception):
        pass

    def build(*args, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(pask_jax.llm, "LLM", build)
    value = str(tmp_path / "grammars") if given == "DIR" else given
    argv = ["run", "-i", str(requests_file), "-o", str(tmp_path / "o.jsonl"), "--method", "full"]
    with pytest.raises(Built) as built:
        cli.main([*argv, *(["--grammar-cache", value] if value else [])])
    options = built.value.args[0]
    assert options.get("grammar_cache_dir") == value  # not given: LLM's default (the environment decides)
    assert not (tmp_path / "grammars").exists()  # made when a grammar is first written


def test_run_refuses_a_missing_policy_for_every_method(tmp_path: Path, requests_file: Path, capsys):
    for method in ("pask", "full"):  # ignored by full KV, but a mistyped path is a mistake all the same
        argv = ["run", "-i", str(requests_file), "-o", str(tmp_path / "o.jsonl"), "--method", method]
        assert str(tmp_path / "nope") in usage_error([*argv, "--policy", str(tmp_path / "nope")], capsys)


def test_run_makes_missing_output_directories_below_an_existing_one(tmp_path: Path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "new" / "deeper" / "out.jsonl"
    with pytest.raises(SystemExit) as exit_info:  # an empty batch is no error: "0 requests", an empty output
        cli.main(["run", "-i", str(empty), "-o", str(out), "--method", "full"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 0
    assert "0 requests" in err and "nan" not in err.lower()
    assert out.is_file() and out.read_text() == ""


def test_run_refuses_an_output_under_a_file(tmp_path: Path, requests_file: Path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = usage_error(["run", "-i", str(requests_file), "-o", str(blocker / "out.jsonl")], capsys)
    assert "-o/--output" in err and f"{blocker} is a file" in err


def test_batch_summary_line_has_no_nan():
    from pask_jax.batch_file import BatchSummary

    assert BatchSummary().line() == "0 requests: nothing to answer"
    line = BatchSummary(requests=2, skipped=2).line()  # a rerun with everything answered: nothing was measured
    assert "nan" not in line and line.endswith("kept/full KV -")
    assert BatchSummary(requests=1, completed=1, kept_ratios=[0.25]).line().endswith("kept/full KV 0.250")


def test_compare_refuses_missing_files_and_says_so_for_an_empty_input(tmp_path: Path, requests_file: Path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("")
    assert "input" in usage_error(["compare", str(tmp_path / "missing.jsonl"), str(out)], capsys)
    err = usage_error(["compare", str(requests_file), str(out), str(tmp_path / "missing-out.jsonl")], capsys)
    assert "output" in err and "missing-out.jsonl: no such file" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", str(empty), str(out)])
    printed = capsys.readouterr().out
    assert exit_info.value.code == 0 and "0 requests" in printed and "nan" not in printed.lower()


def test_calibrate_refuses_bad_paths_and_settings_before_the_model(tmp_path: Path, requests_file: Path, capsys):
    out = str(tmp_path / "policy")
    stats_dir = tmp_path / "stats-less"
    stats_dir.mkdir()
    presence = Path(__file__).parents[2] / "results" / "policies" / "qwen2.5-coder-0.5b-own16" / "stats.json"
    cases = {
        "--stats /pask-jax-missing.json: no such file": ["--stats", "/pask-jax-missing.json"],
        f"--stats {stats_dir}: the directory holds no stats.json": ["--stats", str(stats_dir)],
        "--data": ["--data", str(tmp_path / "missing.jsonl")],
        "give one of them": ["--data", str(requests_file), "--stats", str(stats_dir)],
        "--value nll ranks precision actions: calibrate with --low-storage": ["--value", "nll"],
        "--dev-fraction splits --data": ["--dev-fraction", "0.2"],
        "argument --dev-fraction": ["--data", str(requests_file), "--dev-fraction", "1"],
        "--contexts, --layouts and --target canonical are for BFCL": ["--data", str(requests_file), "--contexts", "0"],
        "argument --contexts": ["--contexts", "0,-2048"],
        "layout 'middle'": ["--layouts", "question_last,middle"],
        "argument --budgets": ["--budgets", "0.2,1.5"],
        "argument --levels": ["--levels", "0.25,0.5"],  # 0 must be among them
        "argument --floor-share": ["--floor-share", "2"],
        "argument --tolerance": ["--tolerance", "-0.1"],
        "argument --groups": ["--groups", "0"],
        "--checkpoint": ["--checkpoint", str(requests_file)],
        f"--high-stats {stats_dir}: the directory holds no stats.json": ["--high-stats", str(stats_dir)],
        "--window sets the full-precision window of a two-pool policy": ["--window", "32"],
        "calibrated without --low-storage, nothing to pair": ["--high-stats", str(presence)],
    }
    for named, flags in cases.items():
        assert named in usage_error(["calibrate", "--out", out, *flags], capsys), flags
    assert "--out" in usage_error(["calibrate", "--out", str(requests_file)], capsys)  # a file, not a directory
    err = usage_error(["calibrate", "--out", "/pask-jax-no-such-root-dir/policy"], capsys)
    assert "--out" in err and "does not exist" in err
    assert not Path(out).exists()


def test_bfcl_refuses_bad_settings_before_the_model(tmp_path: Path, policy_dir: Path, capsys):
    cases = {
        "--methods: unknown method 'magic'": ["--methods", "full,magic"],
        "--categories: unknown 'simple'": ["--categories", "simple"],
        "argument --budget": ["--budget", "0.5,2"],
        "--policy x=": ["--policy", f"x={tmp_path / 'no-policy'}"],
        "--method-config": ["--method-config", str(tmp_path / "missing.toml")],
        "--out": ["--out", str(tmp_path)],
        "argument --limit": ["--limit", "0"],
        "argument --length-buckets": ["--length-buckets", "256,x"],
        "past the end of the evaluation part of multiple (155)": ["--categories", "multiple", "--offset", "160"],
    }
    for named, flags in cases.items():
        assert named in usage_error(["bfcl", *flags], capsys), flags
    err = usage_error(["bfcl", "--out", "/pask-jax-no-such-root-dir/r.json"], capsys)
    assert "--out" in err and "does not exist" in err
    other = tmp_path / "other.json"  # a results file to resume, made with other settings
    other.write_text(json.dumps({"model": "qwen2.5-coder-0.5b", "config": {"limit": 3}, "runs": []}))
    assert "limit" in usage_error(["bfcl", "--out", str(other)], capsys)
    other.write_text("[")
    assert "not a BFCL results file" in usage_error(["bfcl", "--out", str(other)], capsys)


def test_niah_refuses_bad_paths_and_settings_before_the_model(tmp_path: Path, policy_dir: Path, capsys):
    out = str(tmp_path / "niah.json")
    cases = {
        "--policy": ["--policy", str(tmp_path / "no-policy")],
        "--method-config": ["--method-config", str(tmp_path / "missing.toml")],
        "budget 1.5 must be in (0, 1]": ["--budgets", "0.1,1.5"],
        "none is for plain pask": ["--policy", "x=none"],  # niah's own check, also before loading
    }
    for named, flags in cases.items():
        assert named in usage_error(["niah", "--out", out, *flags], capsys), flags
    assert "--out" in usage_error(["niah", "--out", str(tmp_path)], capsys)
    assert "does not exist" in usage_error(["niah", "--out", "/pask-jax-no-such-root-dir/r.json"], capsys)


def test_argparse_errors_are_one_line(capsys):
    assert "required: -i/--input" in usage_error(["run", "-o", "out.jsonl"], capsys)
    assert "argument --ablation: invalid choice" in usage_error(["calibrate", "--out", "p", "--ablation", "x"], capsys)


def test_policy_entries_default_plain_pask_to_auto_and_refuse_a_repeated_label(tmp_path: Path, policy_dir: Path):
    """One `--policy [LABEL=]VALUE` reading for bfcl, niah and bench compile: bare is plain pask's, auto unless given
    (and only where a spec runs it), none for PASK uncalibrated."""
    labelled = arguments.labelled_policies
    assert labelled([str(policy_dir), f"tol={policy_dir}"]) == {"pask": str(policy_dir), "tol": str(policy_dir)}
    assert labelled([], ["full", "snapkv"]) == {}  # nothing runs plain pask's policy: nothing to resolve
    assert labelled([], ["full", "pask"]) == {"pask": "auto"}
    assert labelled([], ["pask:w8"]) == {"pask": "auto"}  # a variant without a policy of its own runs pask's
    assert labelled([f"tol={policy_dir}"], ["pask:tol"]) == {"tol": str(policy_dir)}
    assert labelled(["none"], ["pask"]) == {"pask": "none"} == labelled(["pask=none"], ["pask"])
    assert labelled(["tol=auto"], ["pask"]) == {"tol": "auto", "pask": "auto"}
    refusals = {
        "each label once": [str(policy_dir), f"pask={policy_dir}"],
        "with a path": ["tol="],
        "none is for plain pask": ["tol=none"],
        "no such policy directory": [f"tol={tmp_path / 'missing'}"],
    }
    for message, entries in refusals.items():
        with pytest.raises(arguments.UsageError, match=message):
            labelled(entries)


class Ran(Exception):
    """Raised where a command would start its model work, carrying what it would run with."""


def fake_checkpoint(monkeypatch) -> None:
    """`Checkpoint.open` -> a checkpoint with the fingerprint the shipped 0.5B policy fits, and nothing else."""
    from pask_jax.checkpoint import Checkpoint
    from pask_jax.policy import SHIPPED_POLICIES, PersistencePolicy

    fits = PersistencePolicy.load(SHIPPED_POLICIES / "qwen2.5-coder-0.5b").fits
    fake = argparse.Namespace(fingerprint=fits, tokenizer=None, chat_template=None, weights=lambda *a, **k: None)
    monkeypatch.setattr(Checkpoint, "open", classmethod(lambda cls, name: fake))
    monkeypatch.setattr("pask_jax.experiments.commands.enable_compile_cache", lambda: None)


def shipped_hash() -> str:
    from pask_jax.policy import SHIPPED_POLICIES, PersistencePolicy

    return PersistencePolicy.load(SHIPPED_POLICIES / "qwen2.5-coder-0.5b").content_hash()


def test_bfcl_runs_pask_under_the_shipped_policy_by_default_and_uncalibrated_under_policy_none(
    monkeypatch, policy_dir: Path
):
    """`--policy` as `pask-jax run` reads it: auto (the default) is the shipped policy that fits the model, none is
    PASK uncalibrated; the policies handed to the sweep (and recorded in its results file with their hashes)."""
    from pask_jax.experiments.bfcl import evaluate
    from pask_jax.factory import resolve_spec

    fake_checkpoint(monkeypatch)

    def run_bfcl(model, tokenizer, name, cfg, *, method_config, policies, **kwargs):
        raise Ran(policies, evaluate.run_config(cfg, method_config, policies))

    monkeypatch.setattr(evaluate, "run_bfcl", run_bfcl)

    def ran(*flags):
        with pytest.raises(Ran) as info:
            cli.main(["bfcl", "--methods", "full,pask", *flags])
        return info.value.args

    policies, config = ran()
    assert set(policies) == {"pask"} and policies["pask"].content_hash() == shipped_hash()
    assert resolve_spec("pask", {}, policies).policy is policies["pask"]
    assert config["policies"]["pask"]["content_hash"] == shipped_hash()
    assert ran("--policy", "auto")[0]["pask"].content_hash() == shipped_hash()
    policies, config = ran("--policy", "none")
    assert policies == {} and config["policies"] == {}
    assert resolve_spec("pask", {}, policies).policy is None  # PASK uncalibrated
    with pytest.raises(Ran) as info:  # no spec runs plain pask's policy: none is resolved or recorded
        cli.main(["bfcl", "--methods", "full"])
    assert info.value.args[0] == {}


def test_niah_runs_plain_pask_under_the_shipped_policy_by_default_and_uncalibrated_under_policy_none(monkeypatch):
    from pask_jax.experiments import niah

    fake_checkpoint(monkeypatch)

    def check_methods(cfg, method_config, policies, fingerprint):
        raise Ran(cfg.methods, policies)

    monkeypatch.setattr(niah, "check_methods", check_methods)

    def ran(*flags):
        with pytest.raises(Ran) as info:
            cli.main(["niah", "--out", "/tmp/pask-jax-never-written.json", *flags])
        return info.value.args

    methods, policies = ran()
    assert "pask" in methods and policies["pask"].content_hash() == shipped_hash()
    methods, policies = ran("--policy", "none", "--policy", "shipped=auto")
    assert "pask:shipped" in methods and set(policies) == {"shipped"}  # plain pask uncalibrated beside it
    assert policies["shipped"].content_hash() == shipped_hash()


def test_run_policy_none_is_pask_uncalibrated():
    args = argparse.Namespace(method="pask", method_config=None, budget=0.33, policy="none")
    assert cli._llm_options(args)["policy"] is None  # LLM(policy=None): PASK uncalibrated
    args.policy = "auto"
    assert cli._llm_options(args)["policy"] == "auto"


def test_bench_help_names_every_benchmark(capsys):
    """`pask-jax bench --help` (and `pask-jax --help`) list every benchmark: every module of experiments/bench with a
    `main`, each with its line."""
    import pask_jax.experiments.bench as bench

    modules = sorted(
        p.stem for p in Path(bench.__file__).parent.glob("*.py") if p.stem[0] != "_" and "\ndef main(" in p.read_text()
    )
    assert sorted(bench.BENCHMARKS) == modules
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for name, about in bench.BENCHMARKS.items():
        assert re.search(rf"^  {name} +{re.escape(about)}$", out, re.MULTILINE), name
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = " ".join(capsys.readouterr().out.split())  # argparse wraps the help column
    assert "benchmarks: " + " | ".join(bench.BENCHMARKS) in top

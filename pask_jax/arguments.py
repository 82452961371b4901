"""The command line's front door, JAX-free: argument types and path checks that every subcommand (and the
experiments' subcommands) runs before anything loads.

Value checks are argparse `type=` functions (`argument --budget: ...`); paths are checked by each subcommand's
`check` once the command line is parsed. Either way the error is one line on stderr, `pask-jax CMD: error: ...`, exit
status 2. Output paths: a missing parent directory is created when the output is written (`mkdir -p`, as batch tools
do), but only below an existing directory other than the filesystem root: `/missing-dir/out.jsonl` is refused (a new
top-level directory is almost always a typo), and so is a parent that is a file or cannot be written.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

METHOD_NAMES = (
    *("full", "random", "streamingllm", "h2o", "snapkv", "pyramidkv", "dapq", "pask", "kivi", "int8", "fp8"),
    "triaxialkv",
)  # = methods.METHODS
STORAGE_NAMES = ("bf16", "int8", "fp8", "int4")  # what `NAME@STORAGE` may store an eviction method's entries as
LOW_STORAGE_NAMES = ("kivi2", "kivi4")  # `calibrate --low-storage`: the block formats (`storage.BLOCK_FORMATS`)
# = structure.backend.BACKENDS: ours (schema translation + outlines-core; "-loose": unenforced constraints dropped,
# not refused), llguidance's compiler, or per request ours where it enforces every keyword, else llguidance
GRAMMAR_BACKENDS = ("outlines", "outlines-loose", "llguidance", "auto")
DEFAULT_GRAMMAR_BACKEND = "llguidance"  # what `LLM`, `pask-jax run` and calibration on your own data compile with
# the evaluation protocol's (the experiments, their calibration and the benches' workloads): every committed number
# was decoded under it, so it stays fixed whatever the default is
PROTOCOL_GRAMMAR_BACKEND = "outlines"
DEFAULT_PREP_WORKERS = 2  # = llm.LLM's: host threads compiling grammars while the device runs


def method_spec(spec: str) -> str:
    """`NAME`, `NAME:LABEL` (a labelled variant of the method config), either with `@STORAGE` (the cache's entries
    stored as int8, fp8 or int4 instead of bf16), checked without importing JAX."""
    base, _, storage = spec.partition("@")
    if base.partition(":")[0] not in METHOD_NAMES:
        known = ", ".join(METHOD_NAMES)
        raise argparse.ArgumentTypeError(f"unknown method {spec!r}; known: {known} (or NAME:LABEL, NAME@STORAGE)")
    if "@" in spec and storage not in STORAGE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown storage {storage!r} in {spec!r}; one of {', '.join(STORAGE_NAMES)}")
    return spec


def grammar_backend(name: str) -> str:
    """A grammar backend, its optional package importable (found without importing it; "auto" needs llguidance only
    for the schemas ours does not enforce, and says so for those)."""
    import importlib.util

    if name not in GRAMMAR_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"unknown grammar backend {name!r}; choose one of {', '.join(GRAMMAR_BACKENDS)}"
        )
    if name == "llguidance" and importlib.util.find_spec("llguidance") is None:
        raise argparse.ArgumentTypeError("llguidance is not installed: pip install llguidance==1.9.1")
    return name


POLICY_META = "policy.json"  # what makes a directory a policy (`pask_jax.policy.PersistencePolicy.load`)
STATS_FILE = "stats.json"  # = pask_jax.policy.STATS_FILE (kept here: the front door imports no JAX)
GRAMMAR_CACHE_OFF = ("none", "off")  # = pask_jax.structure.grammar_cache.OFF


class UsageError(ValueError):
    """A command line that cannot run: the message names the argument and what is wrong with it."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with each error on one line, `pask-jax CMD: error: MESSAGE`, exit status 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def parse_number(text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def budget_value(text: str) -> float:
    """A KV budget in (0, 1]."""
    value = parse_number(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"budget {text} must be in (0, 1] (full KV: 1)")
    return value


def budget_list(text: str) -> str:
    """Comma-separated budgets, each in (0, 1]; returned as given (the commands split it, and calibrate records it)."""
    for item in text.split(","):
        if not item.strip():
            raise argparse.ArgumentTypeError(f"{text!r}: an empty entry in the comma-separated budgets")
        if not 0.0 < parse_number(item.strip()) <= 1.0:
            raise argparse.ArgumentTypeError(f"{text}: every budget must be in (0, 1], not {item.strip()}")
    return text


def level_list(text: str) -> str:
    """Calibration keep levels: comma-separated fractions in [0, 1], 0 among them; returned as given."""
    values = [parse_number(item.strip()) for item in text.split(",")]
    if not all(0.0 <= v <= 1.0 for v in values) or 0.0 not in values:
        raise argparse.ArgumentTypeError(f"{text!r}: every level must be in [0, 1], and 0 among them")
    return text


def int_list(text: str) -> str:
    """Comma-separated positive integers (prompt lengths); returned as given."""
    for item in text.split(","):
        if parse_number(item.strip(), int) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: every entry must be a positive integer")
    return text


def int_at_least(low: int):
    def check(text: str) -> int:
        value = parse_number(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} must be >= {low}")
        return value

    return check


def positive(text: str) -> float:
    value = parse_number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def float_in(low: float, high: float | None = None, *, open_high: bool = False):
    """A number in [low, high] ([low, high) with `open_high`; >= low without `high`)."""

    def check(text: str) -> float:
        value = parse_number(text)
        if value < low or (high is not None and (value >= high if open_high else value > high)):
            bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}{')' if open_high else ']'}"
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return value

    return check


def input_file(path: str, flag: str) -> None:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise UsageError(f"{flag} {path}: {'a directory' if p.is_dir() else 'not a regular file'}, not an input file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{flag} {path}: not readable")


def check_creatable(path: str, flag: str) -> None:
    """`path` does not exist: refuse it unless its missing parents can be made (see above)."""
    absolute = Path(os.path.abspath(path))
    ancestor, missing = absolute.parent, []
    while not ancestor.exists():
        missing.append(ancestor)
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a directory")
    if missing and ancestor == Path(ancestor.anchor):
        raise UsageError(
            f"{flag} {path}: directory {missing[-1]} does not exist (a typo?); missing directories are made only "
            f"below an existing one other than {ancestor}: create it first if it is meant"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot create it: {ancestor} is not writable")


def output_file(path: str, flag: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: a directory; give the path of a file")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
    else:
        check_creatable(path, flag)


def output_dir(path: str, flag: str) -> None:
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{flag} {path}: a file; give the path of a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: not writable")
    else:
        check_creatable(path, flag)


def policy_dir(path: str, flag: str, alternatives: str = "") -> None:
    p = Path(path)
    if not p.exists():
        raise UsageError(
            f"{flag}: no such policy directory {path} (give a directory from `pask-jax calibrate`{alternatives})"
        )
    if not p.is_dir():
        raise UsageError(f"{flag}: {path} is a file; a policy is a directory from `pask-jax calibrate`{alternatives}")
    if not (p / POLICY_META).is_file():
        raise UsageError(f"{flag}: {path} holds no policy (no {POLICY_META}); create one with `pask-jax calibrate`")


AUTO_POLICY, NO_POLICY = "auto", "none"  # `--policy` words: the shipped policy that fits the model; PASK uncalibrated
PLAIN_PASK = "pask"  # the label of plain `pask`'s policy (`factory.resolve_spec`)


def policy_spec(value: str | None) -> str | None:
    """A `--policy` value as the one resolver takes it (`pask_jax.policy.resolve_policy`, behind `LLM` and every
    command): `none` -> None (PASK uncalibrated: recency with sinks); `auto` and a directory as they are."""
    return None if value in (None, NO_POLICY) else value


def check_policy(value: str, flag: str) -> None:
    """A `--policy` value every command takes: auto, none, or a policy directory."""
    if value not in (AUTO_POLICY, NO_POLICY):
        policy_dir(value, flag, f", or {AUTO_POLICY} or {NO_POLICY}")


def labelled_policies(entries: list[str], methods: Sequence[str] = ()) -> dict[str, str]:
    """`--policy [LABEL=]VALUE` entries of a method sweep -> {label: value}, VALUE auto, none or a policy directory.
    A bare VALUE is plain `pask`'s policy (label "pask"), which is auto unless an entry names it: added here when one
    of `methods` runs it (plain `pask`, or a `pask:LABEL` with no policy of its own). LABEL=VALUE is `pask:LABEL`'s
    (none only for plain pask: an uncalibrated pask:LABEL is plain pask). Each label once."""
    out: dict[str, str] = {}
    for entry in entries:
        label, _, value = entry.rpartition("=")
        label = label or PLAIN_PASK
        if not value or label in out:
            raise UsageError(f"--policy {entry!r}: give [LABEL=]PATH (or auto, none) with a path and each label once")
        if value == NO_POLICY and label != PLAIN_PASK:
            raise UsageError(f"--policy {entry!r}: {NO_POLICY} is for plain pask (PASK uncalibrated), not pask:{label}")
        check_policy(value, f"--policy {entry}")
        out[label] = value
    if PLAIN_PASK not in out and any(
        name == PLAIN_PASK and label not in out for name, _, label in (spec.partition(":") for spec in methods)
    ):
        out[PLAIN_PASK] = AUTO_POLICY
    return out


def method_specs(text: str, flag: str) -> None:
    specs = [s.strip() for s in text.split(",")]
    if not all(specs):
        raise UsageError(f"{flag} {text!r}: an empty entry in the comma-separated list")
    for spec in specs:
        try:
            method_spec(spec)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{flag}: {e}") from None

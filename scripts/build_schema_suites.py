"""Pin subsets of two external JSON Schema suites (read offline): a small one for the tests, a large one for the
coverage benchmark.

    python scripts/build_schema_suites.py --test-suite GIT_DIR --maskbench GIT_DIR [--out tests/data/schema_suites]
    python scripts/build_schema_suites.py --scale large --test-suite GIT_DIR --maskbench GIT_DIR \
        --out results/schema_suites_large

- ``--test-suite``: a clone of github.com/json-schema-org/JSON-Schema-Test-Suite; every file of
  ``tests/draft2020-12`` (not ``optional/``), at most ``TEST_SUITE_GROUPS`` schema groups of each.
- ``--maskbench``: a clone of github.com/guidance-ai/jsonschemabench; ``maskbench/data``, ``MASKBENCH_SAMPLE``
  schemas of each named subset (the tool-definition subsets first; no Kubernetes / CloudFormation blobs).
- ``--scale large``: gzip-compressed files of every schema group of the test suite's draft2020-12 files, and
  ``MASKBENCH_LARGE_SAMPLE`` schemas of each of MaskBench's subsets but Kubernetes (its schemas are whole cluster
  APIs, megabytes each).

Both are read with ``git show`` at ``--test-suite-commit`` / ``--maskbench-commit`` (default HEAD; the resolved
commit is recorded in the output). The sample is fixed by a hash: the items of a file (or subset) are sorted by
``sha256(SEED + name)`` and the first ones kept, whatever the engines later do on them. Each output file holds the
source, commit, path and selection rule, then ``{"suite": [{"id", "schema", "tests": [{"data", "valid",
"description"}]}]}``; annotations in MaskBench's ``meta`` and its validator messages are dropped. The licence of
each source is copied beside its file.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
from pathlib import Path

SEED = "pask-jax schema suites v1"
TEST_SUITE_PATH = "tests/draft2020-12"
TEST_SUITE_GROUPS = 4  # schema groups kept per keyword file
MASKBENCH_PATH = "maskbench/data"
MASKBENCH_SAMPLE = {  # subset -> schemas kept
    "Glaiveai2K": 80,
    "BFCL": 80,
    "MCPspec": 20,
    "Github_easy": 20,
    "Handwritten": 10,
}
MASKBENCH_LARGE_SAMPLE = {  # the large selection: 100 of each subset (all of a smaller one), 1,345 schemas
    subset: 100
    for subset in (
        "Glaiveai2K",
        "BFCL",
        "MCPspec",
        "Github_trivial",
        "Github_easy",
        "Github_medium",
        "Github_hard",
        "Github_ultra",
        "JsonSchemaStore",
        "Snowplow",
        "Synthesized",
        "Handwritten",
        "WashingtonPost",
        "JME",
    )
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def ranked(names: list[str]) -> list[str]:
    """``names`` in the fixed pseudo-random order of the sample."""
    return sorted(names, key=lambda name: hashlib.sha256(f"{SEED}/{name}".encode()).hexdigest())


def test_cases(tests: list[dict]) -> list[dict]:
    return [{"description": t.get("description", ""), "valid": t["valid"], "data": t["data"]} for t in tests]


def test_suite(repo: Path, commit: str, per_file: int | None = TEST_SUITE_GROUPS) -> dict:
    """The draft2020-12 files' first `per_file` schema groups each in the sample's order (None: every group)."""
    files = [
        n for n in git(repo, "ls-tree", "--name-only", f"{commit}:{TEST_SUITE_PATH}").split() if n.endswith(".json")
    ]
    cases = []
    for name in sorted(files):
        groups = json.loads(git(repo, "show", f"{commit}:{TEST_SUITE_PATH}/{name}"))
        keys = {f"{name}#{i}": group for i, group in enumerate(groups)}
        for key in sorted(ranked(list(keys))[:per_file], key=lambda k: int(k.rpartition("#")[2])):
            group = keys[key]
            cases.append({
                "id": f"{key} {group['description']}",
                "schema": group["schema"],
                "tests": test_cases(group["tests"]),
            })  # fmt: skip
    return {
        "source": "github:json-schema-org/JSON-Schema-Test-Suite",
        "commit": commit,
        "path": TEST_SUITE_PATH,
        "selection": "every file, every schema group"
        if per_file is None
        else f"every file, the first {per_file} schema groups by sha256({SEED!r} + 'file#index')",
        "license": "LICENSE.JSON-Schema-Test-Suite",
        "suites": {"draft2020-12": cases},
    }


def maskbench(repo: Path, commit: str, sample: dict[str, int] = MASKBENCH_SAMPLE) -> dict:
    names = git(repo, "ls-tree", "--name-only", f"{commit}:{MASKBENCH_PATH}").split()
    suites = {}
    for subset, count in sample.items():
        members = [n for n in names if n.split("---")[0] == subset or n.startswith(f"{subset}_")]
        cases = []
        for name in sorted(ranked(members)[:count]):
            item = json.loads(git(repo, "show", f"{commit}:{MASKBENCH_PATH}/{name}"))
            cases.append(
                {"id": name.removesuffix(".json"), "schema": item["schema"], "tests": test_cases(item["tests"])}
            )
        suites[subset] = cases
    return {
        "source": "github:guidance-ai/jsonschemabench",
        "commit": commit,
        "path": MASKBENCH_PATH,
        "selection": f"per subset, the first N files by sha256({SEED!r} + name): {sample}",
        "license": "LICENSE.jsonschemabench",
        "suites": suites,
    }


def maskbench_license(repo: Path, commit: str) -> str:
    """jsonschemabench ships no licence file; say so, with where its data come from (its README)."""
    files = git(repo, "ls-tree", "--name-only", commit).split()  # the top level only
    shipped = [f for f in files if f.upper().partition(".")[0] in ("LICENSE", "LICENCE", "COPYING")]
    if shipped:
        return git(repo, "show", f"{commit}:{shipped[0]}")
    return (
        f"github.com/guidance-ai/jsonschemabench at commit {commit} ships no LICENSE file (nor does\n"
        "github.com/epfl-dlab/jsonschemabench). Its README says the schemas were collected from public sources\n"
        "(json-schema-corpus, GlaiveAI function-calling data, Kubernetes, BFCL, the MCP specification, ...); the\n"
        "instances were generated with Llama 3.1 70B. The pinned sample is kept here for offline testing only, with\n"
        "its source and commit recorded in maskbench.json; see https://arxiv.org/abs/2501.10868 for the data's\n"
        "description.\n"
    )


def write(path: Path, data: dict) -> int:
    """The suite file (gzip-compressed when its name ends in .gz); its size in bytes."""
    text = (json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    path.write_bytes(gzip.compress(text, mtime=0) if path.suffix == ".gz" else text)
    return path.stat().st_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--test-suite", type=Path, required=True, help="git dir or clone of JSON-Schema-Test-Suite")
    p.add_argument("--test-suite-commit", default="HEAD")
    p.add_argument("--maskbench", type=Path, required=True, help="git dir or clone of guidance-ai/jsonschemabench")
    p.add_argument("--maskbench-commit", default="HEAD")
    p.add_argument("--out", type=Path, default=Path("tests/data/schema_suites"))
    p.add_argument("--scale", choices=("small", "large"), default="small", help="the tests' sample or the large one")
    args = p.parse_args()
    large = args.scale == "large"
    args.out.mkdir(parents=True, exist_ok=True)
    suite_commit = git(args.test_suite, "rev-parse", args.test_suite_commit).strip()
    bench_commit = git(args.maskbench, "rev-parse", args.maskbench_commit).strip()
    (args.out / "LICENSE.JSON-Schema-Test-Suite").write_text(git(args.test_suite, "show", f"{suite_commit}:LICENSE"))
    (args.out / "LICENSE.jsonschemabench").write_text(maskbench_license(args.maskbench, bench_commit))
    suffix = ".json.gz" if large else ".json"  # the large selection is 11 MB of JSON, 1.5 MB compressed
    for name, data in (
        (
            "json_schema_test_suite" + suffix,
            test_suite(args.test_suite, suite_commit, None if large else TEST_SUITE_GROUPS),
        ),
        (
            "maskbench" + suffix,
            maskbench(args.maskbench, bench_commit, MASKBENCH_LARGE_SAMPLE if large else MASKBENCH_SAMPLE),
        ),
    ):
        size = write(args.out / name, data)
        counts = {suite: len(cases) for suite, cases in data["suites"].items()}
        print(f"{args.out / name}: {size / 1024:.0f} KiB, {counts}")


if __name__ == "__main__":
    main()

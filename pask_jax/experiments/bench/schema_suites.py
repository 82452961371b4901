"""What the schema benchmarks share: the pinned suites, the instance texts, engine workers, jsonschema's verdicts.

``schemas`` (coverage), ``schema_masks`` (mask time and agreement over a real tokenizer) and ``schema_generation``
(greedy constrained generation) build on these.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import referencing.exceptions

COMPILED, REFUSED, CRASHED, TIMEOUT = "compiled", "refused", "crashed", "timeout"


@dataclasses.dataclass
class Case:
    """One schema of a suite and its labelled instances (``{"data", "valid", "description"}``)."""

    suite: str
    id: str
    schema: Any
    tests: list[dict]


def suite_files(directory: Path) -> list[Path]:
    """The pinned suite files in ``directory``: ``*.json``, or gzip-compressed ``*.json.gz``."""
    return sorted([*directory.glob("*.json"), *directory.glob("*.json.gz")])


def load_suites(directory: Path) -> tuple[list[Case], list[dict]]:
    """The pinned suite files in ``directory`` -> (every case, each file's provenance: source, commit, selection)."""
    cases, sources = [], []
    for path in suite_files(directory):
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
        sources.append({"file": path.name, **{k: data[k] for k in ("source", "commit", "path", "selection")}})
        for suite, items in data["suites"].items():
            cases.extend(Case(suite, item["id"], item["schema"], item["tests"]) for item in items)
    return cases, sources


# ---------------------------------------------------------------------------------------------------------------
# Instances -> the texts every engine is asked to accept


def _branches(schema: Any, root: Any, depth: int = 0) -> Iterator[dict]:
    """``schema`` and, through local ``$ref`` and the combinators, every schema whose ``properties`` apply."""
    if not isinstance(schema, dict) or depth > 8:
        return
    yield schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        yield from _branches(target, root, depth + 1)
    for keyword in ("allOf", "anyOf", "oneOf"):
        for branch in schema.get(keyword) or []:
            yield from _branches(branch, root, depth + 1)


def declaration_order(data: Any, schemas: list[Any], root: Any) -> Any:
    """``data`` with each object's keys in declaration order (declared keys first), as far as the schema says."""
    flat = [s for schema in schemas for s in _branches(schema, root)]
    if isinstance(data, dict):
        objects = [s for s in flat if isinstance(s.get("properties"), dict)]
        # a branch declaring every key first (anyOf branches differ in order), then the keys the others declare
        objects.sort(key=lambda s: not set(data) <= set(s["properties"]))
        declared = [name for s in objects for name in s["properties"]]
        order = [*dict.fromkeys(k for k in declared if k in data), *(k for k in data if k not in declared)]
        values = {key: [s["properties"][key] for s in flat if key in (s.get("properties") or {})] for key in order}
        return {key: declaration_order(data[key], values[key], root) for key in order}
    if isinstance(data, list):
        items = [s["items"] for s in flat if isinstance(s.get("items"), dict)]
        return [declaration_order(item, items, root) for item in data]
    return data


def serializations(data: Any, schema: Any) -> list[bytes]:
    """The texts an instance is tried as: as given, then in declaration order when that differs."""
    texts = [
        json.dumps(data, ensure_ascii=False),
        json.dumps(declaration_order(data, [schema], schema), ensure_ascii=False),
    ]
    return [text.encode() for text in dict.fromkeys(texts)]


# ---------------------------------------------------------------------------------------------------------------
# Engines in worker processes


class Refused(Exception):
    """The engine declines the schema; ``keyword`` groups the refusals."""

    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword


class Worker:
    """One engine in a spawned process, restarted after a timeout or a death. ``serve(engine, *args, conn)`` is the
    process's loop: it sends "ready", then answers each task (a tuple) with a dict; None ends it."""

    def __init__(self, engine: str, serve: Callable, args: tuple = ()):
        self.engine, self.process, self.conn = engine, None, None
        self.serve, self.args = serve, args

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=self.serve, args=(self.engine, *self.args, child), daemon=True)
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{self.engine}: the worker did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.process = None

    def ask(self, task: tuple, timeout: float) -> dict:
        """Send one task, wait for its dict: a timeout or a dead worker becomes a TIMEOUT / CRASHED dict."""
        if self.process is None:
            self.start()
        try:
            self.conn.send(task)
            if self.conn.poll(timeout):
                return self.conn.recv()
            self.stop()
            return {"status": TIMEOUT, "message": f"no answer within {timeout:g} s"}
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self.process.exitcode if self.process else None
            self.stop()
            return {"status": CRASHED, "message": f"the worker process died (exit code {code})"}


def answer_tasks(conn, handle: Callable[..., dict]) -> None:
    """A worker process's loop after start-up: sends "ready", then answers each task with ``handle(*task)``'s dict
    (any exception it raises: a CRASHED dict naming it) until None arrives."""
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            result = handle(*task)
        except Exception as exc:
            result = {"status": CRASHED, "message": f"{type(exc).__name__}: {exc}"[:300]}
        conn.send(result)


# ---------------------------------------------------------------------------------------------------------------
# jsonschema's verdict


def failing_keywords(schema: Any, data: Any) -> list[str]:
    """The keywords jsonschema says ``data`` fails (leaves of anyOf / oneOf errors; ``format:NAME`` for formats)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    found: list[str] = []

    def walk(errors) -> None:
        for error in errors:
            if error.context:
                walk(error.context)
            keyword = str(error.validator)
            found.append(f"format:{error.validator_value}" if keyword == "format" else keyword)

    try:
        walk(validator.iter_errors(data))
    except (jsonschema.exceptions.SchemaError, referencing.exceptions.Unresolvable):
        return ["(schema not checkable)"]
    return list(dict.fromkeys(found))

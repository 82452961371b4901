"""`pask-jax run`: an OpenAI Batch input file through an `LLM`, resumable by `custom_id`.

Input lines: `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`. Output lines, in the
order batches finish: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion>},
"error": null}`, or for a line that cannot run `{"id", "custom_id", "response": null, "error": {"code", "message",
"line"}}` (custom_id null when the line has none). Every line is validated, and every request rendered and its grammar
compiled, before the model's weights load; a bad line gets its error record and the rest go on.

Resuming: a rerun with the same output file skips every custom_id (and every id-less line number) already in it,
so nothing is computed twice; results are appended and flushed (and fsynced) batch by batch, and a torn last line
left by a kill is cut off, so nothing is half-written or lost.

Several processes (`jax.distributed`, e.g. the hosts of a TPU slice): every process reads the whole input, so
envelope errors such as a duplicate custom_id are judged alike everywhere, and process p of n answers the lines whose
0-based line index i has i mod n == p (an interleaved split: long and short requests spread evenly). Each writes its
own file, `<output>.<p>-of-<n>` (`process_output_path`), with the records of its own lines only and the same resuming
rule; a rerun with the same n continues every part. Together the parts hold one record per input line, as one
process's output would (`cat <output>.*-of-<n>` merges them; records carry their custom_id, order is free).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from pask_jax.requests import PreparedRequest
from pask_jax.structure.schema import GrammarError

BATCH_URL = "/v1/chat/completions"


@dataclasses.dataclass
class BatchLine:
    line: int  # 1-based line number in the input
    custom_id: str | None
    body: dict | None = None
    error: tuple[str, str] | None = None  # (code, message)

    @property
    def key(self) -> str:
        return self.custom_id if self.custom_id is not None else f"line:{self.line}"


def read_input(path: Path) -> list[BatchLine]:
    """Parse and check every input line's envelope (bodies are checked by the request builder)."""
    lines, seen = [], set()
    with path.open(encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                lines.append(BatchLine(number, None, error=("invalid_json", f"line {number} is not JSON: {e}")))
                continue
            custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
            entry = BatchLine(number, custom_id if isinstance(custom_id, str) and custom_id else None)
            if not isinstance(obj, dict):
                entry.error = ("invalid_request", f"line {number} is not a JSON object")
            elif entry.custom_id is None:
                entry.error = ("missing_custom_id", f"line {number} has no custom_id (a non-empty string)")
            elif entry.custom_id in seen:
                entry.error = ("duplicate_custom_id", f"custom_id {entry.custom_id!r} appears twice (line {number})")
            elif obj.get("method", "POST") != "POST" or obj.get("url", BATCH_URL) != BATCH_URL:
                entry.error = ("invalid_url", f"only POST {BATCH_URL} is supported, got {obj.get('url')!r}")
            elif not isinstance(obj.get("body"), dict):
                entry.error = ("invalid_request", f"custom_id {entry.custom_id!r} has no body object")
            else:
                entry.body = obj["body"]
            if entry.custom_id is not None:
                seen.add(entry.custom_id)
            lines.append(entry)
    return lines


def answered_keys(path: Path) -> dict[str, bool]:
    """Keys (custom_id, or "line:N" for id-less lines) already in an output file -> whether answered without error;
    cuts off a torn last line."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # killed mid-write: the partial line never counted
        data = data[: data.rfind(b"\n") + 1]
        with path.open("r+b") as f:
            f.truncate(len(data))
    keys = {}
    for raw in data.decode("utf-8").splitlines():
        record = json.loads(raw)
        error = record.get("error")
        key = record.get("custom_id") or (f"line:{error.get('line')}" if error else None)
        if key is not None:
            keys[key] = error is None
    return keys


def _record_id(key: str) -> str:
    return "batch_req_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def error_record(entry: BatchLine, code: str, message: str) -> dict:
    return {
        "id": _record_id(entry.key),
        "custom_id": entry.custom_id,
        "response": None,
        "error": {"code": code, "message": message, "line": entry.line},
    }


def success_record(entry: BatchLine, completion: dict) -> dict:
    return {
        "id": _record_id(entry.key),
        "custom_id": entry.custom_id,
        "response": {"status_code": 200, "request_id": completion["id"], "body": completion},
        "error": None,
    }


class _Appender:
    """Appends whole lines and makes them durable before returning."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        if records:
            self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


@dataclasses.dataclass
class BatchSummary:
    requests: int = 0  # lines of the input (of this process's share)
    skipped: int = 0  # already in the output
    failed: int = 0  # error records written by this run
    failed_before: int = 0  # error records an earlier run wrote for this input
    completed: int = 0
    output_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    kept_ratios: list[float] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        if self.requests == 0:
            return "0 requests: nothing to answer"
        rate = self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0
        kept = f"{sum(self.kept_ratios) / len(self.kept_ratios):.3f}" if self.kept_ratios else "-"  # "-": none ran
        return (
            f"{self.requests} requests: {self.completed} completed, {self.failed + self.failed_before} failed, "
            f"{self.skipped} already answered; {self.output_tokens} output tokens at {rate:.2f} tokens/s; "
            f"kept/full KV {kept}"
        )


def process_output_path(output_path: str | Path, process: int = 0, processes: int = 1) -> Path:
    """The file process `process` of `processes` writes: `output_path` itself for one process, else
    `<output_path>.<process>-of-<processes>`."""
    if not 0 <= process < processes:
        raise ValueError(f"process {process} is not in 0..{processes - 1}")
    output_path = Path(output_path)
    return output_path if processes == 1 else output_path.with_name(f"{output_path.name}.{process}-of-{processes}")


def _error_code(error: Exception) -> str:
    """A request that failed in `LLM.generate`: its grammar did not compile on a worker, or its cache is too large."""
    return "invalid_request" if isinstance(error, GrammarError) else "kv_memory"


def run_batch(
    llm_factory: Callable[[], object],
    input_path: str | Path,
    output_path: str | Path,
    *,
    process: int = 0,
    processes: int = 1,
) -> BatchSummary:
    """Every unanswered input line of this process's share through the LLM that `llm_factory` builds (called once,
    after the envelopes are read: an input with nothing left to do loads nothing). Process `process` of `processes`
    answers the lines with index mod `processes` == `process` into `process_output_path(output_path, ...)`."""
    input_path = Path(input_path)
    output_path = process_output_path(output_path, process, processes)
    if not input_path.is_file():
        raise ValueError(f"input file {input_path} does not exist")
    if output_path.resolve() == input_path.resolve():
        raise ValueError("the output file must not be the input file")
    start = time.perf_counter()
    lines = [entry for entry in read_input(input_path) if (entry.line - 1) % processes == process]
    done = answered_keys(output_path)
    summary = BatchSummary(requests=len(lines))
    todo = [entry for entry in lines if entry.key not in done]
    summary.skipped = len(lines) - len(todo)
    summary.failed_before = sum(1 for entry in lines if done.get(entry.key) is False)
    out = _Appender(output_path)
    try:
        errors = [error_record(e, *e.error) for e in todo if e.error is not None]
        out.write(errors)
        summary.failed += len(errors)
        todo = [e for e in todo if e.error is None]
        if not todo:
            return summary
        llm = llm_factory()
        prepared: list[tuple[BatchLine, PreparedRequest]] = []
        errors = []
        for entry in todo:
            try:
                prepared.append((entry, llm.prepare(entry.body, ahead=True)))
            except ValueError as e:  # RequestError, GrammarError, a prompt past the context
                errors.append(error_record(entry, "invalid_request", str(e)))
        out.write(errors)
        summary.failed += len(errors)
        with tqdm(total=len(prepared), desc="run", unit="request", file=sys.stderr) as progress:
            for indices, results in llm.generate([p for _, p in prepared]):
                pairs = list(zip(indices, results, strict=True))
                failed = [(i, r) for i, r in pairs if isinstance(r, Exception)]
                completions = [r for _, r in pairs if not isinstance(r, Exception)]
                out.write(
                    [error_record(prepared[i][0], _error_code(r), str(r)) for i, r in failed]
                    + [success_record(prepared[i][0], r) for i, r in pairs if not isinstance(r, Exception)]
                )
                summary.failed += len(failed)
                for completion in completions:
                    summary.completed += 1
                    summary.output_tokens += completion["usage"]["completion_tokens"]
                    summary.decode_s += completion["pask"]["decode_s"]
                    summary.kept_ratios.append(completion["pask"]["kept_ratio_mean"])
                summary.wall_s = time.perf_counter() - start
                progress.update(len(indices))
                progress.set_postfix(tokens_per_s=f"{summary.output_tokens / summary.wall_s:.2f}")
    finally:
        out.close()
        summary.wall_s = time.perf_counter() - start
    return summary

"""Compiled grammars on disk: a new process (or another host) loads a grammar compiled before instead of paying the
~1 s of Index construction and role walk per tool list over Qwen's vocabulary again.

**Where.** ``set_grammar_cache(directory)`` (``LLM(grammar_cache_dir=...)``, ``pask-jax run --grammar-cache``), else
``$PASK_JAX_GRAMMAR_CACHE``, else ``$PASK_JAX_CACHE/grammars`` (``~/.cache/pask-jax/grammars``); ``none`` / ``off``
(or None) keeps grammars in memory only. The setting is process-wide, as JAX's compilation cache directory is.

**What.** One file per grammar, named by the hash of everything that determines it: the caller's key (the regex's
hash, the kind, framing, parallel, the vocabulary's content hash), the outlines-core version and ``FORMAT_VERSION``,
so an upgrade never reads an older entry. A file is an uncompressed ``.npz``: the Index in outlines-core's own
binary serialization (what its pickling uses, ``Index.from_binary``) and the role tables as integer arrays. No
pickle: a file in a shared directory is data, never code. Loading takes milliseconds (``pask-jax bench grammars``).

**Concurrency.** A writer writes a temporary file in the same directory and renames it into place (``os.replace``,
atomic on POSIX filesystems), so a reader sees a whole file or none, and concurrent writers of one key leave one of
their identical files. A file that cannot be read or does not hold its key is a miss: the grammar is compiled again
and the file rewritten. A failed write warns and is otherwise ignored. Nothing is evicted: delete the directory to
reclaim its space.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import NamedTuple

import numpy as np
from outlines_core import Index

from pask_jax.models.fetch import cache_dir

ENV = "PASK_JAX_GRAMMAR_CACHE"
OFF = ("none", "off")  # a setting naming no directory: grammars stay in memory
FORMAT_VERSION = 1  # bump when the file's layout or the role tables' meaning changes
OUTLINES_CORE_VERSION = version("outlines_core")


class RoleTables(NamedTuple):
    """What the breadth-first role walk gives (``grammar._role_tables``): see ``CompiledGrammar``."""

    edge_roles: dict[tuple[int, int], int]
    token_roles: dict[tuple[int, int], int]
    state_roles: dict[int, int]
    witnesses: dict[int, bytes]


AUTO = "auto"  # no choice made here: the environment decides
_setting: str | os.PathLike | None = AUTO


def set_grammar_cache(directory: str | os.PathLike | None) -> None:
    """Keep compiled grammars in ``directory`` from now on, process-wide; None, ``"none"`` or ``"off"``: in memory
    only; ``"auto"``: as the environment says (the default)."""
    global _setting
    _setting = directory


def grammar_cache_dir() -> Path | None:
    """The directory compiled grammars persist in now (None: none)."""
    setting = _setting if _setting != AUTO else os.environ.get(ENV) or cache_dir() / "grammars"
    if setting is None or str(setting).lower() in OFF:
        return None
    return Path(setting).expanduser()


def _entry(directory: Path, key: tuple) -> tuple[Path, str]:
    """The file of ``key`` and the text it must hold (the whole key, versions included)."""
    text = repr((FORMAT_VERSION, OUTLINES_CORE_VERSION, *key))
    return directory / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}.npz", text


def _pairs(table: dict[tuple[int, int], int]) -> np.ndarray:
    return np.array([(*k, v) for k, v in table.items()], dtype=np.int64).reshape(-1, 3)


def _arrays(key_text: str, index: Index, tables: RoleTables) -> dict[str, np.ndarray]:
    _, (index_bytes,) = index.__reduce__()  # outlines-core pickles an Index as from_binary(bytes)
    states = list(tables.witnesses)
    return {
        "key": np.array(key_text),
        "index": np.frombuffer(index_bytes, dtype=np.uint8),
        "edge_roles": _pairs(tables.edge_roles),
        "token_roles": _pairs(tables.token_roles),
        "state_roles": np.array(list(tables.state_roles.items()), dtype=np.int64).reshape(-1, 2),
        "witness_states": np.array(states, dtype=np.int64),
        "witness_ends": np.cumsum([len(tables.witnesses[s]) for s in states], dtype=np.int64),
        "witness_bytes": np.frombuffer(b"".join(tables.witnesses.values()), dtype=np.uint8),
    }


def _tables(arrays) -> RoleTables:
    ends = arrays["witness_ends"].tolist()
    blob = arrays["witness_bytes"].tobytes()
    starts = [0, *ends[:-1]]
    return RoleTables(
        edge_roles={(a, b): r for a, b, r in arrays["edge_roles"].tolist()},
        token_roles={(a, t): r for a, t, r in arrays["token_roles"].tolist()},
        state_roles={s: r for s, r in arrays["state_roles"].tolist()},
        witnesses={s: blob[i:j] for s, i, j in zip(arrays["witness_states"].tolist(), starts, ends, strict=True)},
    )


def load(key: tuple) -> tuple[Index, RoleTables] | None:
    """The Index and role tables stored under ``key``, or None: no cache directory, no file, or one that cannot be
    read or holds another key (a miss, as for JAX's compilation cache; the caller compiles and stores again)."""
    directory = grammar_cache_dir()
    if directory is None:
        return None
    path, text = _entry(directory, key)
    try:
        with np.load(path, allow_pickle=False) as arrays:
            if arrays["key"].item() != text:
                return None
            return Index.from_binary(arrays["index"].tobytes()), _tables(arrays)
    except Exception:  # a missing, truncated or corrupt file, whatever numpy or outlines-core raise for it
        return None


def store(key: tuple, index: Index, tables: RoleTables) -> None:
    """Write ``index`` and ``tables`` under ``key`` atomically (a temporary file renamed into place); warn if the
    directory cannot be written."""
    directory = grammar_cache_dir()
    if directory is None:
        return
    path, text = _entry(directory, key)
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=path.stem, suffix=".tmp", delete=False) as tmp:
            np.savez(tmp, **_arrays(text, index, tables))
        os.replace(tmp.name, path)
    except OSError as exc:
        warnings.warn(f"grammar cache {directory}: cannot write a compiled grammar ({exc})", stacklevel=3)
    finally:
        if tmp is not None:  # renamed into place, or left behind by a failed write
            with contextlib.suppress(OSError):
                os.unlink(tmp.name)

"""The compiled-grammar cache on disk (``structure.grammar_cache``): a grammar loaded in a fresh process state is the
one compiled; another vocabulary or regex misses; a damaged entry is a miss and is rewritten; concurrent writers
leave a whole file; the off switch writes nothing.

The grammars are compiled over a tiny byte-level vocabulary (the 256 single bytes, a few multi-byte tokens and the
framing special tokens), in milliseconds.
"""

from __future__ import annotations

import threading

import pytest

from pask_jax.structure import compile_grammar, compile_json_grammar
from pask_jax.structure import grammar as G
from pask_jax.structure import grammar_cache as C

SPECIALS = ("<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>")
WORDS = (b'{"name": "', b'", "arguments": {"', b'": ', b"}}\n", b" null", b' ""', b' "', b"12")
FACT = {
    "name": "fact",
    "parameters": {
        "type": "object",
        "properties": {"number": {"type": "integer"}, "note": {"type": ["string", "null"]}},
        "required": ["number"],
    },
}
CALL = b'\x02\n{"name": "fact", "arguments": {"number": 12, "note": null}}\n\x03'


class TinyTokenizer:
    """What ``grammar_vocabulary`` reads of a tokenizer: every id's bytes, the special tokens, the EOS ids."""

    def __init__(self, extra: tuple[bytes, ...] = ()):
        self.tokens = [bytes([i]) for i in range(256)] + list(WORDS + extra) + [s.encode() for s in SPECIALS]
        self.special_tokens = {s: len(self.tokens) - len(SPECIALS) + i for i, s in enumerate(SPECIALS)}
        self.eos_token_ids = (self.special_tokens["<|im_end|>"], self.special_tokens["<|endoftext|>"])

    def all_token_bytes(self) -> list[bytes]:
        return self.tokens

    def ids(self, text: bytes) -> list[int]:
        """``text`` (framing as marker bytes) as single-byte ids, then the end of turn."""
        markers = {2: self.special_tokens["<tool_call>"], 3: self.special_tokens["</tool_call>"]}
        return [markers.get(b, b) for b in text] + [self.special_tokens["<|im_end|>"]]


@pytest.fixture(scope="module")
def tok() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Grammars persist in a temporary directory; each test starts with the in-memory cache empty (as a new process
    does) and leaves it and the setting as they were."""
    saved = dict(G._GRAMMARS)
    G._GRAMMARS.clear()
    C.set_grammar_cache(tmp_path / "grammars")
    yield tmp_path / "grammars"
    C.set_grammar_cache("auto")
    G._GRAMMARS.clear()
    G._GRAMMARS.update(saved)


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The regexes compiled from scratch (not loaded) from now on."""
    built = []
    build = G._build

    def counted(regex, *args):
        built.append(regex)
        return build(regex, *args)

    monkeypatch.setattr(G, "_build", counted)
    return built


def fresh_process_state() -> None:
    G._GRAMMARS.clear()


def entries(directory) -> list:
    return sorted(directory.glob("*.npz"))


def assert_same_grammar(loaded: G.CompiledGrammar, compiled: G.CompiledGrammar, path: list[int]) -> None:
    """The same automaton and role tables, and the same masks and roles along ``path``."""
    assert loaded is not compiled
    assert loaded.index.get_transitions() == compiled.index.get_transitions()
    assert loaded.final_states == compiled.final_states
    for table in ("edge_roles", "token_roles", "state_roles", "witnesses"):
        assert getattr(loaded, table) == getattr(compiled, table), table
    assert loaded.walk(path) == compiled.walk(path)
    state = compiled.initial_state
    for token in path[:-1]:
        assert loaded.index.get_allowed_tokens(state) == compiled.index.get_allowed_tokens(state)
        state = compiled.index.get_next_state(state, token)


def test_a_fresh_process_state_loads_the_same_grammar(tok, cache, builds):
    compiled = compile_grammar([FACT], tok)
    assert len(builds) == 1 and len(entries(cache)) == 1
    assert compiled.token_roles  # ' null' and ' ""' end the note on one edge in different roles: both tables tested
    fresh_process_state()
    loaded = compile_grammar([FACT], tok)
    assert len(builds) == 1, "loaded from disk, not compiled again"
    assert_same_grammar(loaded, compiled, tok.ids(CALL))
    assert loaded.accepts(tok.ids(CALL)) and loaded.roles_s == 0.0
    assert compile_grammar([FACT], tok) is loaded  # then from memory


def test_json_grammars_are_stored_too(tok, cache, builds):
    compiled = compile_json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}, tok)
    fresh_process_state()
    loaded = compile_json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}, tok)
    assert len(builds) == 1
    assert_same_grammar(loaded, compiled, tok.ids(b'{"a": 12}'))


def test_another_vocabulary_or_regex_misses(tok, cache, builds):
    compile_grammar([FACT], tok)
    fresh_process_state()
    compile_grammar([FACT], TinyTokenizer(extra=(b"fact",)))  # another vocabulary
    compile_grammar([FACT], tok, parallel=False)  # another regex
    compile_grammar([{**FACT, "name": "fact2"}], tok)
    assert len(builds) == 4 and len(entries(cache)) == 4


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "another key"])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(tok, cache, builds, damage):
    compiled = compile_grammar([FACT], tok)
    [path] = entries(cache)
    whole = path.read_bytes()
    if damage == "another key":  # a whole entry, but of another grammar (a file copied under the wrong name)
        compile_grammar([FACT], tok, parallel=False)
        damaged = next(p for p in entries(cache) if p != path).read_bytes()
    else:
        damaged = {"truncated": whole[: len(whole) // 2], "garbage": b"\x00grammar" * 64, "empty": b""}[damage]
    path.write_bytes(damaged)
    fresh_process_state()
    assert compile_grammar([FACT], tok).regex == compiled.regex
    assert builds.count(compiled.regex) == 2, "compiled again"
    assert path.read_bytes() != damaged, "and rewritten"
    fresh_process_state()
    assert_same_grammar(compile_grammar([FACT], tok), compiled, tok.ids(CALL))
    assert builds.count(compiled.regex) == 2, "the rewritten entry loads"


def test_concurrent_writers_leave_a_whole_file(tok, cache):
    """Writers of one key race while a reader loads whenever the file exists: what exists is always whole."""
    grammar = compile_grammar([FACT], tok)
    key = next(iter(G._GRAMMARS))
    [path] = entries(cache)
    path.unlink()
    tables = C.RoleTables(grammar.edge_roles, grammar.token_roles, grammar.state_roles, grammar.witnesses)
    start, done, seen = threading.Barrier(9), threading.Event(), []

    def write():
        start.wait()
        for _ in range(5):
            C.store(key, grammar.index, tables)

    def read():
        start.wait()
        while not done.is_set():
            if path.exists():
                seen.append(C.load(key))

    writers = [threading.Thread(target=write) for _ in range(8)]
    reader = threading.Thread(target=read)
    for t in [*writers, reader]:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert seen and all(s is not None and s[1] == tables for s in seen)
    assert entries(cache) == [path] and not list(cache.glob("*.tmp"))
    index, loaded = C.load(key)
    assert loaded == tables and index.get_transitions() == grammar.index.get_transitions()


@pytest.mark.parametrize("off", [None, "none", "OFF"])
def test_the_off_switch_writes_nothing(tok, tmp_path, monkeypatch, builds, off):
    monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path / "home"))
    C.set_grammar_cache(off)
    compile_grammar([FACT], tok)
    fresh_process_state()
    compile_grammar([FACT], tok)
    assert len(builds) == 2 and not list(tmp_path.rglob("*.npz"))


def test_where_grammars_persist(tmp_path, monkeypatch):
    monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("PASK_JAX_GRAMMAR_CACHE")
    C.set_grammar_cache("auto")
    assert C.grammar_cache_dir() == tmp_path / "grammars"
    monkeypatch.setenv("PASK_JAX_GRAMMAR_CACHE", "off")
    assert C.grammar_cache_dir() is None
    monkeypatch.setenv("PASK_JAX_GRAMMAR_CACHE", str(tmp_path / "shared"))
    assert C.grammar_cache_dir() == tmp_path / "shared"
    C.set_grammar_cache(tmp_path / "mine")  # the process's own choice comes first
    assert C.grammar_cache_dir() == tmp_path / "mine"


def test_an_unwritable_directory_warns_and_compiles(tok, tmp_path, builds):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    C.set_grammar_cache(blocker / "grammars")
    with pytest.warns(UserWarning, match="cannot write a compiled grammar"):
        grammar = compile_grammar([FACT], tok)
    assert grammar.accepts(tok.ids(CALL)) and len(builds) == 1

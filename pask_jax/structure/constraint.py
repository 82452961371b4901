"""The host side of constrained decoding: packed token masks before each step, token roles after it."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from outlines_core import Guide

from pask_jax.structure.grammar import CompiledGrammar
from pask_jax.structure.lexer import LEX_PROSE, lex_token
from pask_jax.structure.roles import NO_TOOL, Role

# a call's function name, as every call framing writes it (the envelope is JSON; names hold no quotes)
_CALLED_NAME = re.compile(rb'"name"\s*:\s*"([^"\\]*)"')


@runtime_checkable
class TokenConstraint(Protocol):
    """What the engine's decode loop asks of a constraint, once per step for the whole batch."""

    def mask(self) -> np.ndarray:
        """i32[B, ceil(V/32)] packed bits: bit j of word w allows token 32w+j."""
        ...

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        """Feed the sampled tokens i32[B] -> their role ids i32[B] (stored with the cache entries)."""
        ...

    def called_tools(self) -> np.ndarray:
        """i32[B]: per row, the index of the tool the call being written calls, once its name is written (NO_TOOL:
        no call, or its name not complete yet)."""
        ...


def packed_bits(tokens: Sequence[int], words: int) -> np.ndarray:
    """i32[words]: the packed mask allowing exactly ``tokens``."""
    row = np.zeros(words, np.uint32)
    for token in tokens:
        row[token >> 5] |= np.uint32(1 << (token & 31))
    return row.view(np.int32)


def called_tool(seen: bytearray, raw: bytes, function_names: Sequence[str]) -> int:
    """Feed a token's bytes to the current call's bytes ``seen`` -> the index of the function it calls once its name
    is complete (``seen`` is then cleared), else NO_TOOL."""
    if not function_names:
        return NO_TOOL
    seen += raw
    if (match := _CALLED_NAME.search(seen)) is None:
        return NO_TOOL
    name = match.group(1).decode("utf-8", "replace")  # before the clear: the match reads the buffer itself
    seen.clear()
    return function_names.index(name) if name in function_names else NO_TOOL


class RowConstraint:
    """What the grammar constraints share: one grammar per row, finished rows masked to the EOS ids (any further
    token taken without error: the engine keeps stepping finished rows; END_OF_TURN for an EOS id, else
    FREE_TEXT), the called tool read from the call's bytes, host seconds in ``mask_s`` / ``advance_s`` over ``steps``.
    A backend gives ``_row_mask`` (a live row's mask, written in place) and ``_row_advance`` (feed a live row's
    token -> its role)."""

    def __init__(self, grammars: Sequence, vocab_size: int):
        if not grammars:
            raise ValueError(f"{type(self).__name__} needs one compiled grammar per sequence, got none")
        for g in grammars:
            if vocab_size < g.vocab.size:
                raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {g.vocab.size} token ids")
        self.grammars = list(grammars)
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.finished = np.zeros(len(self.grammars), bool)
        self.called = np.full(len(self.grammars), NO_TOOL, np.int32)
        self._call_bytes = [bytearray() for _ in self.grammars]  # the current call's bytes until its name is read
        self._prose = [LEX_PROSE] * len(self.grammars)  # a text answer's lexer state
        self._stop_rows = [packed_bits(g.vocab.stop_ids, self.words) for g in self.grammars]
        self.mask_s = 0.0
        self.advance_s = 0.0
        self.steps = 0

    @property
    def batch(self) -> int:
        return len(self.grammars)

    def _row_mask(self, row: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def _row_advance(self, row: int, token: int) -> int:
        raise NotImplementedError

    def mask(self) -> np.ndarray:
        """i32[B, ceil(V/32)]: bit j of word w allows token 32w+j."""
        start = time.perf_counter()
        out = np.zeros((self.batch, self.words), np.int32)
        for i in range(self.batch):
            if self.finished[i]:
                out[i] = self._stop_rows[i]
            else:
                self._row_mask(i, out[i])
        self.mask_s += time.perf_counter() - start
        return out

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        """Feed each row its sampled token -> i32[B] roles (stored with the cache entries)."""
        start = time.perf_counter()
        tokens = np.asarray(tokens).reshape(-1)
        if tokens.shape[0] != self.batch:
            raise ValueError(f"advance got {tokens.shape[0]} tokens for a batch of {self.batch}")
        roles = np.empty(self.batch, np.int32)
        for i, grammar in enumerate(self.grammars):
            token = int(tokens[i])
            if self.finished[i]:
                roles[i] = Role.END_OF_TURN if token in grammar.vocab.stop_ids else Role.FREE_TEXT
            else:
                roles[i] = self._row_advance(i, token)
        self.advance_s += time.perf_counter() - start
        self.steps += 1
        return roles

    def _prose_role(self, row: int, role: int, raw: bytes) -> int:
        """A text answer's token (FREE_TEXT) through the prose lexer: a call written in the text takes its roles."""
        if role != Role.FREE_TEXT or not raw:
            return role
        self._prose[row], role, _ = lex_token(self._prose[row], raw)
        return role

    def _read_called(self, row: int, raw: bytes) -> None:
        if self.called[row] == NO_TOOL:
            self.called[row] = called_tool(self._call_bytes[row], raw, self.grammars[row].function_names)

    def _forget_called(self, row: int) -> None:
        """A call ended: the next one's tool is not known yet."""
        self.called[row] = NO_TOOL
        self._call_bytes[row].clear()

    def called_tools(self) -> np.ndarray:
        return self.called.copy()

    def timing(self) -> dict[str, float]:
        """Host seconds spent in mask() and advance(), in total and per step."""
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "mask_s": self.mask_s,
            "advance_s": self.advance_s,
            "parser_s_per_step": (self.mask_s + self.advance_s) / steps,
        }


class GrammarConstraint(RowConstraint):
    """One outlines-core Guide per sequence: packed token masks before each step, token roles after it.

    A ``TokenConstraint`` (a ``RowConstraint``). Rows may have different grammars. Each token goes through
    ``CompiledGrammar.step`` (the same transition ``CompiledGrammar.walk`` follows), the Guide follows to write the
    next mask. Right after a parallel-call separator a row may take ``<tool_call>`` (the restarted guide) or the end
    of turn (the model often writes "\\n" before <|im_end|>). ``called_tools`` reads the function name of the call
    being written from its bytes (the index into the row's ``function_names``), from the token that closes the name
    until the next call starts. A text answer under ``tool_choice="auto"`` is lexed as prose (``LEX_PROSE``): a call
    the model writes there as text (a json fence, bare JSON) gets the call's roles, not FREE_TEXT, and its function
    name is read as any call's.
    """

    def __init__(self, grammars: Sequence[CompiledGrammar], vocab_size: int):
        super().__init__(grammars, vocab_size)
        self.guides = [Guide(g.index) for g in self.grammars]
        self.states = [g.initial_state for g in self.grammars]
        self.between_calls = np.zeros(len(self.grammars), bool)
        # between calls (only where <tool_call> is atomic): another call or the end
        # (a tokenizer without <tool_call> special tokens has no call_open_id: its rows never stand between calls)
        self._between_rows = [
            packed_bits([i for i in (g.vocab.end_of_turn_id, g.vocab.call_open_id) if i is not None], self.words)
            for g in self.grammars
        ]

    def _row_mask(self, row: int, out: np.ndarray) -> None:
        if self.between_calls[row]:  # set only where call_open_id exists
            out[:] = self._between_rows[row]
        else:  # zero-fills and sets the words of the tokenizer's ids; the model's padding ids stay 0
            self.guides[row].write_mask_into(out.ctypes.data, -(-self.grammars[row].vocab.size // 32), 4)

    def _row_advance(self, row: int, token: int) -> int:
        grammar, state = self.grammars[row], self.states[row]
        step = grammar.step(state, bool(self.between_calls[row]), token)
        if step is None:
            raw = grammar.vocab.token_bytes[token] if 0 <= token < grammar.vocab.size else b"?"
            raise ValueError(
                f"row {row}: token {token} ({raw!r}) is not allowed by the grammar in state {state} (after "
                f"{grammar.witnesses.get(state, b'?')[-60:]!r}); was the mask applied to the logits?"
            )
        raw = grammar.vocab.token_bytes[token]
        role = self._prose_role(row, step.role, raw)
        self.states[row], self.finished[row], self.between_calls[row] = step.state, step.ended, step.between_calls
        self._read_called(row, raw)
        if step.between_calls:
            self._forget_called(row)
            self.guides[row].reset()  # the separator after a parallel call: the next call starts afresh
        elif not step.ended:
            self.guides[row].advance(token, return_tokens=False)
        return role


class SplitConstraint:
    """Rows decoded under different constraints, as one ``TokenConstraint``: each part owns some rows of the batch
    (grammar_backend "auto" decodes our grammars and llguidance's side by side). Host seconds and steps are the
    parts' own."""

    def __init__(self, parts: Sequence[tuple[Sequence[int], RowConstraint]], batch: int):
        self.parts = [(np.asarray(rows, np.int64), constraint) for rows, constraint in parts]
        self.batch = batch
        if sorted(np.concatenate([rows for rows, _ in self.parts]).tolist()) != list(range(batch)):
            raise ValueError(f"the parts must own each of the {batch} rows once")

    def mask(self) -> np.ndarray:
        masks = [(rows, constraint.mask()) for rows, constraint in self.parts]
        out = np.empty((self.batch, masks[0][1].shape[1]), np.int32)  # the parts share the model's vocabulary
        for rows, m in masks:
            out[rows] = m
        return out

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens).reshape(-1)
        if tokens.shape[0] != self.batch:
            raise ValueError(f"advance got {tokens.shape[0]} tokens for a batch of {self.batch}")
        roles = np.empty(self.batch, np.int32)
        for rows, constraint in self.parts:
            roles[rows] = constraint.advance(tokens[rows])
        return roles

    def called_tools(self) -> np.ndarray:
        called = np.empty(self.batch, np.int32)
        for rows, constraint in self.parts:
            called[rows] = constraint.called_tools()
        return called

    @property
    def mask_s(self) -> float:
        return sum(constraint.mask_s for _, constraint in self.parts)

    @property
    def advance_s(self) -> float:
        return sum(constraint.advance_s for _, constraint in self.parts)

    @property
    def steps(self) -> int:
        return max(constraint.steps for _, constraint in self.parts)


class FreeTextConstraint:
    """Unconstrained text as a ``TokenConstraint``: any of the tokenizer's ids until an EOS id, then only EOS ids.

    Generated tokens get FREE_TEXT (END_OF_TURN for an EOS id), so structure-aware methods see what they are; the
    model's padding ids past the tokenizer's vocabulary are never allowed.
    """

    def __init__(self, batch: int, vocab_size: int, tokenizer_size: int, stop_ids: Sequence[int]):
        if not stop_ids:
            raise ValueError("FreeTextConstraint needs the tokenizer's EOS ids to end a turn")
        if tokenizer_size > vocab_size:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {tokenizer_size} token ids")
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        words = -(-vocab_size // 32)
        self._open = packed_bits(range(tokenizer_size), words)
        self._stop = packed_bits(sorted(self.stop_ids), words)
        self.finished = np.zeros(batch, bool)

    def mask(self) -> np.ndarray:
        return np.where(self.finished[:, None], self._stop[None], self._open[None])

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens).reshape(-1)
        if tokens.shape[0] != self.finished.shape[0]:
            raise ValueError(f"advance got {tokens.shape[0]} tokens for a batch of {self.finished.shape[0]}")
        stop = np.isin(tokens, list(self.stop_ids))
        self.finished |= stop
        return np.where(stop, Role.END_OF_TURN, Role.FREE_TEXT).astype(np.int32)

    def called_tools(self) -> np.ndarray:
        return np.full(self.finished.shape[0], NO_TOOL, np.int32)

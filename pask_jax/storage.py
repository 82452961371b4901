"""How a cache stores its K/V, and what each stored entry costs in bytes: the unit of the total KV budget.

A layer group's cache has a **slot pool** (one entry per slot, any slot freed or reused on its own) stored in a
per-token format -- bf16 / f32, int8 or fp8 per token and KV head, or int4 / int2 over groups of channels -- and,
optionally, a **block pool** (`pask_jax.block_pool`) whose entries are written `block` at a time in a format whose
keys are quantized per channel over the block (KIVI's keys), values per token, and a second block pool in another
such format (TriAxialKV's INT4 and INT2 blocks: the method says which pool an entry goes down into). `Storage` names
them.

The budget b is in bytes: the bytes the cache holds for a sequence over the bytes of a full bf16 K/V cache of the
same length (2 bytes an element, no metadata). Every byte an entry holds counts: its codes, its share of scales and
zeros (`quantize.bytes_per_token`), and its metadata -- a slot's position, role (i8), offered tool (i16),
keep-priority (f32) and table entry (i32); a block entry's position and role (i8) plus its share of the block's table
entry (i32). Positions are i16 (`Storage.positions` = 2: sequences of up to 32,768 positions, the default context),
or i32 for longer ones (the engine widens them when its `max_context` asks for more). Full precision counts 2 bytes
an element even where the engine holds f32 (CPU), so a budget means the same on every machine.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pask_jax.kernels.quantize import FULL, PRESETS, KVFormat, bytes_per_token

SLOT_METADATA_BYTES = 1 + 2 + 4 + 4  # beside the position: role i8, tool i16, score f32, table i32
BLOCK_ENTRY_METADATA_BYTES = 1  # beside the position: role i8 (the block's table entry is shared by its entries)
POSITION_DTYPES = {2: jnp.int16, 4: jnp.int32}  # bytes of a stored position -> its dtype
BLOCK_TABLE_BYTES = 4  # i32 per block
FULL_BYTES_PER_ELEMENT = 2  # the budget's reference: bf16 K and V, no metadata
BLOCK_FORMATS = tuple(name for name, (key, _) in PRESETS.items() if key.axis == "channel")  # kivi2, kivi4


def full_entry_bytes(head_dim: int) -> int:
    """Bytes one token of one KV head takes in the budget's reference: bf16 key and value, no metadata."""
    return 2 * FULL_BYTES_PER_ELEMENT * head_dim


@dataclasses.dataclass(frozen=True)
class Storage:
    """A layer group's storage: the slot pool's format and, optionally, the block pool's (key, value) formats and a
    second block pool's (blocks of the same length).

    `window`: with a block pool, the entries the slot pool holds at full precision before its oldest `block` go
    down into a block (KIVI's residual length R); the cap may take them down sooner.
    `positions`: bytes of each entry's stored position, 2 (i16: positions below 32,768) or 4 (i32).
    """

    slots: KVFormat = FULL
    blocks: tuple[KVFormat, KVFormat] | None = None
    second_blocks: tuple[KVFormat, KVFormat] | None = None
    window: int = 0
    positions: int = 2

    def __post_init__(self) -> None:
        if self.positions not in POSITION_DTYPES:
            raise ValueError(f"positions are stored in {list(POSITION_DTYPES)} bytes, not {self.positions}")
        if self.slots.axis == "channel":
            raise ValueError("the slot pool stores entries one by one: its format must be per token, not per channel")
        for key, value in self.block_pools:
            if value.axis == "channel":
                raise ValueError("block-pool values are quantized per token")
            if key.axis != "channel" or key.group < 1:
                raise ValueError("block-pool keys are quantized per channel over the block: give a channel format")
        if self.blocks is None and (self.window or self.second_blocks is not None):
            raise ValueError("a full-precision window or a second block pool needs a block pool")
        if self.second_blocks is not None:
            if self.second_blocks[0].group != self.block:
                raise ValueError("the two block pools take blocks of the same length")
            if self.window < self.block:  # so a full window always holds a whole block of one pool's entries
                raise ValueError(f"two block pools need a window of at least a block ({self.block}), not {self.window}")

    @property
    def block_pools(self) -> tuple[tuple[KVFormat, KVFormat], ...]:
        """The (key, value) formats of each block pool: none, one or two."""
        return tuple(pool for pool in (self.blocks, self.second_blocks) if pool is not None)

    @property
    def block(self) -> int:
        """Entries per block of the block pool (its keys' channel-group length); 0 without one."""
        return 0 if self.blocks is None else self.blocks[0].group

    @property
    def position_dtype(self):
        return POSITION_DTYPES[self.positions]

    @property
    def max_positions(self) -> int:
        """The longest sequence (prompt and generated tokens) whose positions the cache can store."""
        return 2 ** (8 * self.positions - 1)

    @property
    def lossless(self) -> bool:
        """Whether attention reads exactly what was written (full precision, no block pool)."""
        return self.slots.full and self.blocks is None

    @property
    def name(self) -> str:
        """The storage as a method spec names it (`snapkv@int8`): a preset name, or bf16 for full precision."""
        if self.blocks is not None:
            return "+".join(f"kivi{key.bits}" for key, _ in self.block_pools)
        for preset, formats in PRESETS.items():
            if formats == (self.slots, self.slots):
                return "bf16" if preset == "full" else preset
        return repr(self.slots)

    @classmethod
    def parse(cls, name: str) -> Storage:
        """A slot-pool storage by name: bf16 (full precision), int8, fp8 or int4 (per token, groups of 32)."""
        if name in ("bf16", "full"):
            return cls()
        if name not in PRESETS or PRESETS[name][0].axis == "channel":
            slot_formats = ["bf16", *(p for p, (k, _) in PRESETS.items() if k.axis == "token" and p != "full")]
            raise ValueError(
                f"unknown storage {name!r}; an eviction method stores its entries as one of {slot_formats}"
            )
        return cls(slots=PRESETS[name][0])

    @classmethod
    def with_blocks(
        cls, name: str, head_dim: int, group: int = 0, window: int = 0, second: str | None = None
    ) -> Storage:
        """Full-precision slots and a block pool in the block format `name` (kivi2, kivi4) -- and, given `second`, a
        second block pool in that format -- `group` tokens a block (0: the format's) and channels a value group (at
        most head_dim)."""

        def formats(name: str) -> tuple[KVFormat, KVFormat]:
            if name not in BLOCK_FORMATS:
                raise ValueError(f"unknown block format {name!r}; one of {list(BLOCK_FORMATS)}")
            key, value = PRESETS[name]
            size = group or key.group
            return dataclasses.replace(key, group=size), dataclasses.replace(value, group=min(size, head_dim))

        return cls(blocks=formats(name), second_blocks=None if second is None else formats(second), window=window)

    @classmethod
    def for_actions(cls, low: str, high: str, head_dim: int, group: int = 0, window: int = 0) -> Storage:
        """A precision-action cache (PASK): full-precision slots (HIGH, `high` = bf16) over a block pool at `low`;
        or, `high` a block format, a block pool at `high`, a second at `low` and the full-precision window (at
        least a block)."""
        if high in ("bf16", "full"):
            return cls.with_blocks(low, head_dim, group, window)
        block = group or PRESETS[high][0].group
        return cls.with_blocks(high, head_dim, group, max(window, block), second=low)

    def window_bytes(self, head_dim: int) -> float:
        """What the full-precision window holds, per layer and KV head, beyond its entries' bytes in the last block
        pool: `window` entries and half a block on average (it goes down a block at a time)."""
        if self.blocks is None:
            return 0.0
        low = self.block_entry_bytes(head_dim, len(self.block_pools) - 1)
        return (self.window + self.block / 2) * (self.slot_entry_bytes(head_dim) - low)

    def slot_entry_bytes(self, head_dim: int) -> float:
        """Bytes one slot-pool entry (one token of one KV head) holds, metadata included."""
        return 2 * bytes_per_token(self.slots, head_dim) + self.positions + SLOT_METADATA_BYTES

    def action_bytes(self, head_dim: int) -> tuple[float, float, float]:
        """(the reference, LOW, HIGH): the bytes per entry a precision-action policy is compiled for
        (`CompileOptions.entry_bytes`). With one block pool LOW is a block entry and HIGH a full-precision slot
        entry; with two, LOW is an entry of the second pool and HIGH one of the first."""
        if self.second_blocks is not None:
            return full_entry_bytes(head_dim), self.block_entry_bytes(head_dim, 1), self.block_entry_bytes(head_dim)
        return full_entry_bytes(head_dim), self.block_entry_bytes(head_dim), self.slot_entry_bytes(head_dim)

    def block_entry_bytes(self, head_dim: int, pool: int = 0) -> float:
        """Bytes one entry of block pool `pool` holds, its share of the block's scales, zeros and table entry
        included."""
        if pool >= len(self.block_pools):
            raise ValueError(f"this storage has no block pool {pool}")
        key, value = self.block_pools[pool]
        payload = bytes_per_token(key, head_dim) + bytes_per_token(value, head_dim)
        return payload + self.positions + BLOCK_ENTRY_METADATA_BYTES + BLOCK_TABLE_BYTES / self.block

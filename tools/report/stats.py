"""Paired statistics for two methods scored on the same items: ``paired_bootstrap_ci`` (percentile interval of an
accuracy difference, items resampled with replacement, fixed seed) and ``mcnemar_exact_p`` (two-sided exact binomial
test on the discordant items); ``paired`` gives both, with the counts, as a row of a paired table (``PAIRED_HEAD``)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from tools.report.common import _points

RESAMPLES = 10_000
SEED = 0


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p from the discordant counts (items only A gets right, items only B gets right):
    2 P(X <= min(only_a, only_b)) for X ~ Binomial(only_a + only_b, 1/2), at most 1 (1 when none is discordant)."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_a} and {only_b}")
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_bootstrap_ci(
    a: Sequence[bool], b: Sequence[bool], *, resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95
) -> tuple[float, float]:
    """Percentile interval of mean(a) - mean(b) (accuracies as fractions): the items are resampled with replacement
    `resamples` times, item i bringing a[i] and b[i] together (the pairing is kept). Deterministic for a seed."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty outcome lists, got {len(a)} and {len(b)} items")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need resamples >= 1 and level in (0, 1), got {resamples} and {level}")
    diffs = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return means[math.floor(tail * (resamples - 1))], means[math.ceil((1.0 - tail) * (resamples - 1))]


def paired_counts(a: dict[str, bool], b: dict[str, bool]) -> tuple[list[str], int, int]:
    """The items both cover (in a's order), how many only a gets right, and how many only b."""
    items = [i for i in a if i in b]
    return items, sum(a[i] and not b[i] for i in items), sum(b[i] and not a[i] for i in items)


PAIRED_HEAD = ("items", "A right", "B right", "only A", "only B", "A - B, points [95% CI]", "McNemar p")


@dataclasses.dataclass(frozen=True)
class Paired:
    """A against B item by item over the items both scored: counts and the 95% paired bootstrap interval of the
    accuracy difference."""

    items: int
    right_a: int
    right_b: int
    only_a: int
    only_b: int
    low: float
    high: float

    @property
    def difference(self) -> str:  # points, with the interval
        return f"{_points((self.right_a - self.right_b) / self.items)} [{_points(self.low)}, {_points(self.high)}]"

    @property
    def p(self) -> str:  # McNemar's exact p
        return f"{mcnemar_exact_p(self.only_a, self.only_b):.3f}"

    def row(self, label: str) -> list[object]:  # a row of PAIRED_HEAD
        return [label, self.items, self.right_a, self.right_b, self.only_a, self.only_b, self.difference, self.p]


def paired(a: dict[str, bool], b: dict[str, bool]) -> Paired:
    items, only_a, only_b = paired_counts(a, b)
    low, high = paired_bootstrap_ci([a[i] for i in items], [b[i] for i in items])
    right_a, right_b = sum(a[i] for i in items), sum(b[i] for i in items)
    return Paired(len(items), right_a, right_b, only_a, only_b, low, high)


def _paired_row(label: str, a: dict[str, bool], b: dict[str, bool]) -> list[object]:
    """A row of PAIRED_HEAD: counts, the item-weighted accuracy difference with its bootstrap interval, McNemar p."""
    return paired(a, b).row(label)

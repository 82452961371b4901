"""What the schedulers see of a request (`Job`), which requests may share a batch, and static micro-batches.

Requests share a batch (static) or a cache (continuous) only when they sample alike: the same temperature, top-p
and, when sampling, seed (`sampling_groups`). Static batching also keeps constrained and free requests apart and
sorts each group by prompt length into micro-batches of at most `max_batch` rows whose KV cache fits the memory
limit (`micro_batches`; the limit is the `fits` rule `scheduler.Scheduler` gives). The runs themselves:
`scheduler.Scheduler`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pask_jax.runtime.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True, eq=False)
class Job:
    """One request as the schedulers see it: its prompt (token ids, their roles, the tool each describes), its token
    limit, its sampling settings (`sampling`'s `max_new_tokens` is unused) and whether a grammar constrains it."""

    ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    constrained: bool = False
    roles: Sequence[int] | None = None
    tools: Sequence[int] | None = None

    @property
    def sampling_key(self) -> tuple[float, float, int]:
        """What requests sharing a batch must agree on: temperature, top-p and the seed (greedy: any seed)."""
        s = self.sampling
        return s.temperature, s.top_p, s.seed if s.temperature > 0 else 0


class MemoryLimitError(ValueError):
    """A request whose KV cache alone (one row) exceeds the memory limit: yielded in place of its generation."""


def sampling_groups(jobs: Sequence[Job], by_constraint: bool = False) -> list[list[int]]:
    """Indices of jobs that can share a batch: the same sampling key, and with `by_constraint` the same
    constrained-ness; in input order."""
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.sampling_key + ((job.constrained,) if by_constraint else ()), []).append(i)
    return list(groups.values())


def micro_batches(
    jobs: Sequence[Job], max_batch: int, fits: Callable[[Sequence[Job]], bool] | None = None
) -> list[list[int]]:
    """Static batches: indices grouped by sampling settings and constrained-ness, length-sorted, at most `max_batch`
    each and, where `fits` is given, each a batch it accepts (a batch of one always is)."""
    batches = []
    for indices in sampling_groups(jobs, by_constraint=True):
        indices.sort(key=lambda i: len(jobs[i].ids))
        batch: list[int] = []
        for i in indices:
            if batch and (len(batch) == max_batch or (fits is not None and not fits([jobs[j] for j in [*batch, i]]))):
                batches.append(batch)
                batch = []
            batch.append(i)
        batches.append(batch)
    return batches

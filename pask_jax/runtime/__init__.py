"""The runtime: shapes and buckets, sampling, the jitted step around one step-input pytree, prefill, the `Engine`,
the decode rows and the schedulers (static micro-batches and continuous batching).

- `shapes.py`: length buckets, padded batches, new-token buckets, `BatchShape`.
- `sampling.py`: `SamplingConfig`, the masked sampler.
- `step.py`: `StepInput` (what a decode step feeds each row), `StepPlan` (what is static) and the jitted decode step.
- `prefill.py`: the (chunked) prefill and the methods' choice of prompt entries.
- `engine.py`: `Engine`: placement, lowering, precompile, prefill, decode steps, `generate`.
- `rows.py`: `DecodeRows`, the one decode loop over a cache's rows, for static and continuous batching alike.
- `batching.py`: `Job` (a request as the schedulers see it), sampling groups, static micro-batches.
- `scheduler.py`: `Scheduler` (static micro-batches or continuous waves), `ContinuousBatcher`, the memory sums of
  rows.

Attention itself lives in `pask_jax.attention`, the cache in `pask_jax.cache`.
"""

from pask_jax.runtime.engine import Engine, LoweredSteps
from pask_jax.runtime.rows import DecodeRows, Generation, RequestStats, StepTiming
from pask_jax.runtime.sampling import SamplingConfig, mask_words
from pask_jax.runtime.shapes import DEFAULT_LENGTH_BUCKETS, PREFILL_CHUNK, BatchShape, length_bucket
from pask_jax.runtime.step import MethodInputs, StepInput, StepPlan

__all__ = [
    "DEFAULT_LENGTH_BUCKETS",
    "PREFILL_CHUNK",
    "BatchShape",
    "DecodeRows",
    "Engine",
    "Generation",
    "LoweredSteps",
    "MethodInputs",
    "RequestStats",
    "SamplingConfig",
    "StepInput",
    "StepPlan",
    "StepTiming",
    "length_bucket",
    "mask_words",
]

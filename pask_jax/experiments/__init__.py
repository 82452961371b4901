"""The experiments: how the library is measured, through its public API only.

- `bfcl`: BFCL v4 items, the split, BFCL's function dialect and prompt, scoring with its checker, long tool-calling
  prompts, the tuning protocol, calibration on BFCL's calibration part (`pask-jax bfcl`, `pask-jax calibrate`).
- `niah`: needle-in-a-haystack retrieval (`pask-jax niah`).
- `bench`: the benchmarks (`pask-jax bench ...`).

The library never imports this package (a test checks it); the command line registers its subcommands.
"""

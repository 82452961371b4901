"""The experiments: how the library is measured, through its front doors (`LLM`, `Checkpoint`, `make_engine`) and
its parts where a measurement needs them (docs/ARCHITECTURE.md, "What the experiments import").

- `bfcl`: BFCL v4 items, the split, BFCL's function dialect and prompt, scoring with its checker, long tool-calling
  prompts, the tuning protocol, calibration on BFCL's calibration part (`pask-jax bfcl`, `pask-jax calibrate`).
- `niah`: needle-in-a-haystack retrieval (`pask-jax niah`).
- `sweep`: method sweeps sharing one prefill, and a sweep's PASK policies by label.
- `bench`: the benchmarks (`pask-jax bench --help` lists them).

The library never imports this package (a test checks it); the command line registers its subcommands.
"""

"""`python -m pask_jax.experiments.bench BENCHMARK [ARGS]`: the same as `pask-jax bench BENCHMARK [ARGS]`."""

from pask_jax.experiments.bench import main

main()

"""`python -m pask_jax.bench BENCHMARK [ARGS]`: the same as `pask-jax bench BENCHMARK [ARGS]`."""

from pask_jax.bench import main

main()

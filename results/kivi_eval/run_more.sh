#!/bin/sh
# Beside run.sh's rows on the same items (BFCL 185-209 of simple_python, live_simple, live_multiple): the default PASK
# (PASK v2, the shipped policy, bf16 entries), the strongest eviction row of the earlier short-prompt samples, at the
# same byte budgets; nothing about it tuned since it was frozen. One results file per category, resumable per batch.
set -eu
for C in ${CATEGORIES:-simple_python live_simple live_multiple}; do
  pask-jax bfcl --split evaluation --offset 185 --limit 25 --batch-size 8 --max-new-tokens 128 \
    --length-buckets 384,768,3072,6144 --categories "$C" --budget ${BUDGETS:-0.33,0.2,0.1} --methods pask \
    --out "results/kivi_eval/bfcl_items185_209_${C}_more.json"
done

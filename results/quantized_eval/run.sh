#!/bin/sh
# The frozen quantized-cache evaluation: items 110-134 (never scored before), one category per results file,
# resumable per batch (rerun the same command after an interruption). Methods frozen at the commit this file was
# committed with; KIVI at its paper's settings, PASK v2 under the shipped policy (bf16 and int4 entries). The lean grid
# (no fp8, StreamingLLM or b = 0.1) is what 2 CPU cores score in a session.
set -eu
for C in ${CATEGORIES:-simple_python live_simple multiple live_multiple}; do
  pask-jax bfcl --split evaluation --offset 110 --limit 25 --batch-size 8 --max-new-tokens 128 \
    --length-buckets 384,768,3072,6144 --categories "$C" --budget 0.2,0.33 \
    --methods full,kivi,int8,pask,pask@int4 \
    --out "results/quantized_eval/bfcl_items110_134_$C.json"
done

#!/bin/sh
# More rows on the quantized-cache evaluation's items 110-134 (run.sh's files stay as they are): fp8 per token and KV
# head (e4m3, no hyper-parameters) and StreamingLLM at its shipped settings (the strongest bf16 eviction baseline of
# the earlier short-prompt samples beside PASK v2), both chosen before these rows ran and tuned on nothing here.
# One file per category, resumable per batch.
set -eu
for C in ${CATEGORIES:-simple_python live_simple multiple live_multiple}; do
  pask-jax bfcl --split evaluation --offset 110 --limit 25 --batch-size 8 --max-new-tokens 128 \
    --length-buckets 384,768,3072,6144 --categories "$C" --budget 0.2,0.33 \
    --methods fp8,streamingllm \
    --out "results/quantized_eval/bfcl_items110_134_${C}_more.json"
done

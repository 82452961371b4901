#!/bin/sh
# KIVI at the widest precision each byte budget pays for, with positions stored as i16 (a 4-bit block entry then
# costs 0.325 of bf16, so b = 0.33 runs 4 bits, b = 0.2 and 0.1 run 2): BFCL items 185-209 of simple_python,
# live_simple and live_multiple (never scored before; items 35-59 and 135-159 stay reserved; multiple's evaluation
# part ends at 154). KIVI at its paper's settings (group 32, residual 128), frozen at the commit of this file; full
# KV beside it. One results file per category, resumable per batch (rerun the same command after an interruption).
set -eu
for C in ${CATEGORIES:-simple_python live_simple live_multiple}; do
  pask-jax bfcl --split evaluation --offset 185 --limit 25 --batch-size 8 --max-new-tokens 128 \
    --length-buckets 384,768,3072,6144 --categories "$C" --budget ${BUDGETS:-0.33,0.2,0.1} --methods full,kivi \
    --out "results/kivi_eval/bfcl_items185_209_$C.json"
done

#!/bin/sh
# The frozen evaluation of PASK with precision actions: BFCL items 160-184 of the non-parallel categories (never
# scored before; items 35-59 and 135-159 stay reserved), b = 0.1 / 0.2 / 0.33 in bytes; multiple is left out: its
# evaluation part has 155 items, so it has none past 159. One results file per category
# and method group, resumable per batch (rerun the same command after an interruption):
#   base  full KV and PASK v2 (frozen at 00d277f, under the byte cap, the shipped policy)
#   v3    PASK with precision actions under the 17-item policy (results/policies/pask-v3-0.5b-18, the default rule)
#         and KIVI (2 bits at these budgets, its paper's group and window), both frozen at the commit of this line
set -eu
for C in ${CATEGORIES:-simple_python live_simple live_multiple}; do
  for GROUP in ${METHOD_GROUPS:-base v3}; do
    case "$GROUP" in
      base) METHODS="full,pask"; EXTRA="" ;;
      v3) METHODS="pask:v3,kivi"; EXTRA="--policy v3=results/policies/pask-v3-0.5b-18" ;;
      *) echo "unknown group $GROUP" >&2; exit 2 ;;
    esac
    pask-jax bfcl --split evaluation --offset 160 --limit 25 --batch-size 8 --max-new-tokens 128 \
      --length-buckets 384,768,3072,6144 --categories "$C" --budget 0.1,0.2,0.33 --methods "$METHODS" $EXTRA \
      --out "results/actions_eval/bfcl_items160_184_${C}_$GROUP.json"
  done
done

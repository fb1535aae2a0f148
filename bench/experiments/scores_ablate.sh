#!/bin/bash
# Where the scores kernel's time goes (issue 14): the device time of a call at the seed (kernel_times.py, both causal
# and not) with parts of the kernel switched off in the tree's source, which is restored at the end. Run on the GPU
# machine from the repository root. Not a correctness check.
#   PYTHONPATH=. bash bench/experiments/scores_ablate.sh
set -u
SRC=cuda_src/attention/scores_softmax_sm90.cu
cp $SRC /tmp/scores_orig.cu
run() { echo "== $1"; timeout 120 python3 bench/experiments/kernel_times.py --shape ${SHAPE:-32,32,512,512,1024} 2>&1 \
  | grep -A1 "causal=" | grep -v "^--"; }
run baseline
sed -i 's/#define CUPY_ATTN_SCORES_PREFETCH_Q 1/#define CUPY_ATTN_SCORES_PREFETCH_Q 0/' $SRC && run "no Q prefetch into L2"
cp /tmp/scores_orig.cu $SRC
run "baseline again"

#!/bin/bash
# Where the scores kernel's time goes (issue 14): its device time at the seed (kernel_times.py) with parts of the
# epilogue removed from a scratch copy of the source. Run on the GPU machine from the repository root; the tree's own
# source is restored at the end. Not a correctness check: the ablated kernels write wrong P.
#   PYTHONPATH=. bash bench/experiments/scores_ablate.sh
set -u
SRC=cuda_src/attention/scores_softmax_sm90.cu
cp $SRC /tmp/scores_orig.cu
run() { echo "== $1"; timeout 120 python3 bench/experiments/kernel_times.py --shape ${SHAPE:-32,32,512,512,1024} 2>&1 \
  | grep -A1 "causal=" | grep -v "^--"; }
run baseline
sed -i 's/x = exp2f(fmaf(x, c, -m_c\[half\]));/x = exp2_approx(fmaf(x, c, -m_c[half]));/; s/#include "common\/tma.cuh"/#include "common\/tma.cuh"\n#include "common\/mma.cuh"/' $SRC && run "ex2.approx"
# Session 9 (H200, seed fp16, kernel alone): baseline 1.355-1.365 ms, ex2.approx 1.369, and with the 4-byte global
# P stores of that version removed 1.125 (so P moved to TMA stores: 1.18-1.21); a prefetch of Q into L2 1.27 against
# 1.20 without (reverted).
cp /tmp/scores_orig.cu $SRC

#!/bin/bash
# Where the scores kernel's time goes (issue 14): its device time at the seed (kernel_times.py) with parts of the
# epilogue removed from a scratch copy of the source. Run on the GPU machine from the root of the tree to ablate; the
# tree's own source is restored at the end. Not a correctness check: the ablated kernels write wrong P.
# SRC is the source's name up to commit 725cf17 (run it in a worktree of that commit: git worktree add /tmp/old 725cf17
# && cd /tmp/old && PYTHONPATH=. bash <this checkout>/bench/experiments/split/scores_ablate.sh). The sed matches session
# 9's epilogue text only: at 725cf17 it no longer matches, and the "ex2.approx" row times the unedited kernel.
set -u
KERNEL_TIMES="$(dirname "$0")/../tools/kernel_times.py"
SRC=cuda_src/attention/scores_softmax_sm90.cu
cp $SRC /tmp/scores_orig.cu
run() { echo "== $1"; timeout 120 python3 "$KERNEL_TIMES" --shape ${SHAPE:-32,32,512,512,1024} 2>&1 \
  | grep -A1 "causal=" | grep -v "^--"; }
run baseline
sed -i 's/x = exp2f(fmaf(x, c, -m_c\[half\]));/x = exp2_approx(fmaf(x, c, -m_c[half]));/; s/#include "common\/tma.cuh"/#include "common\/tma.cuh"\n#include "common\/mma.cuh"/' $SRC && run "ex2.approx"
# Session 9 (H200, seed fp16, kernel alone): baseline 1.355-1.365 ms, ex2.approx 1.369, and with the 4-byte global
# P stores of that version removed 1.125 (so P moved to TMA stores: 1.18-1.21); a prefetch of Q into L2 1.27 against
# 1.20 without (reverted).
cp /tmp/scores_orig.cu $SRC

#!/bin/bash
# What the FA3 forward's epilogue costs (issue 10: "epilogue through shared memory with TMA or 16-byte stores"): the
# device time of calls (kernel_times.py) with the epilogue's 4-byte global stores of O removed from the tree's source,
# which is restored at the end. Run on the GPU machine from the root of the tree to ablate. Not a correctness check.
# The sed below matches the epilogue's text at commit 725cf17 (the count printed after it must not be 0); to run it
# there: git worktree add /tmp/old 725cf17 && cd /tmp/old && PYTHONPATH=. bash <this checkout>/bench/experiments/...
#   PYTHONPATH=. bash bench/experiments/flash_fwd/fa3_ablate.sh
set -u
KERNEL_TIMES="$(dirname "$0")/../tools/kernel_times.py"
SRC=cuda_src/attention/sm90/epilogue.cuh
cp $SRC /tmp/epilogue_orig.cuh
run() {
  echo "== $1"
  for shape in 8,16,2048,2048,128 8,16,1024,1024,256 4,32,4096,4096,64; do
    timeout 120 python3 "$KERNEL_TIMES" --shape $shape 2>&1 | grep -A1 "causal=" | grep -v "^--"
  done
}
run baseline
sed -i 's/        \*reinterpret_cast<unsigned\*>(orow + col) = pack2<T>(o0, o1);/        if (o0 == 12345.f) *reinterpret_cast<unsigned*>(orow + col) = pack2<T>(o0, o1);/' $SRC
grep -c "12345" $SRC
run "no O stores"
cp /tmp/epilogue_orig.cuh $SRC

#!/bin/bash
# A/B of the Linear-BN-softmax bench (quick) between an older tree and this one, on one machine, interleaved rounds.
#   bash bench/experiments/linear_bn_softmax/ab_lbs_sessions.sh OLD_TREE ROUNDS
old=$1; rounds=${2:-3}
for r in $(seq "$rounds"); do
  for tree in "$old" .; do
    echo "=== round $r tree $tree"
    (cd "$tree" && PYTHONPATH=. python3 bench/bench_linear_bn_softmax.py --quick 2>&1 | grep -E "^\| (name|linear)")
  done
done

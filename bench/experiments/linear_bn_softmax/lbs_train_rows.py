"""Training-step rows of bench_linear_bn_softmax.benchmark_training, N times in one process (the spread of a
host-bound row).

    PYTHONPATH=. python3 bench/experiments/linear_bn_softmax/lbs_train_rows.py N
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import bench_linear_bn_softmax as bench  # noqa: E402


def main(runs: int) -> None:
    for i in range(runs):
        for r in bench.benchmark_training():
            print(f"run {i} {r['name']:34s} {r['dtype']:9s} ms {r['ms']:.3f} torch {r['torch_ms']:.3f} "
                  f"x{r['speedup']:.2f} | loop {r['loop_ms']:.3f} torch {r['torch_loop_ms']:.3f} "
                  f"x{r['loop_speedup']:.2f} | dev {r['device_ms']:.3f} host {r['host_us']:.0f}/{r['torch_host_us']:.0f}",
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)

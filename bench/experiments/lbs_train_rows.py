"""Training-step rows of bench_linear_bn_softmax.benchmark_training, N times in one process (the spread of a
host-bound row).

    PYTHONPATH=. python3 bench/experiments/lbs_train_rows.py N
"""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_linear_bn_softmax as b
for i in range(int(sys.argv[1])):
    for r in b.benchmark_training():
        print(f"run {i} {r['name']:34s} {r['dtype']:9s} ms {r['ms']:.3f} torch {r['torch_ms']:.3f} x{r['speedup']:.2f} | "
              f"loop {r['loop_ms']:.3f} torch {r['torch_loop_ms']:.3f} x{r['loop_speedup']:.2f} | dev {r['device_ms']:.3f} "
              f"host {r['host_us']:.0f}/{r['torch_host_us']:.0f}", flush=True)

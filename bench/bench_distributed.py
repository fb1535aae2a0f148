"""Context-parallel attention on the GPUs of one host: ring and Ulysses schedules against one GPU on the whole sequence.

    torchrun --nproc_per_node 2 bench/bench_distributed.py [--seqlen 32768] [--head-dim 128] [--causal]
    # or, without torchrun: PYTHONPATH=. python bench/bench_distributed.py --spawn 2 ...

Each rank holds a zig-zag shard (cupy_attn.distributed.shard_sequence) of a (1, Hq, L, D) bf16 sequence; the row
reports the median forward (and forward + backward) time per call over the ranks (the slowest rank's), the single-GPU
call's on rank 0 on the whole sequence, and the ratio single / (world · parallel) as the parallel efficiency. NCCL
with NVLink multicast off (NCCL_NVLS_ENABLE=0). Timings: CUDA events around each call after warm-up, ranks
synchronized by a barrier before each round.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _time(fn, reps: int) -> float:
    import torch
    import torch.distributed as dist
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    times.sort()
    return times[len(times) // 2]


def run(args) -> None:
    import torch
    import torch.distributed as dist
    import cupy_attn
    from cupy_attn import distributed as cp_dist
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    g = torch.Generator("cuda").manual_seed(0)
    Hq, Hkv, L, D = args.heads, args.kv_heads, args.seqlen, args.head_dim
    q, k, v = (torch.randn(1, H, L, D, generator=g, device="cuda", dtype=torch.bfloat16) for H in (Hq, Hkv, Hkv))
    local = [cp_dist.shard_sequence(x, rank, world).requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(local[0])
    rows = []
    for schedule in ("ring", "ulysses"):
        if schedule == "ulysses" and (Hq % world or Hkv % world):
            continue

        def fwd(schedule=schedule):
            return cp_dist.context_parallel_attention(*local, is_causal=args.causal, enable_gqa=True,
                                                      schedule=schedule)

        def step(schedule=schedule):
            torch.autograd.grad(fwd(schedule), local, dout)
        for _ in range(3):
            step()
        with torch.no_grad():
            f_ms = _time(fwd, args.reps)
        s_ms = _time(step, args.reps)
        worst = torch.tensor([f_ms, s_ms], device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rows.append((schedule, *worst.tolist()))
    if rank == 0:
        full = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        dfull = torch.randn_like(full[0])

        def single():
            return cupy_attn.scaled_dot_product_attention(*full, is_causal=args.causal, enable_gqa=True)
        for _ in range(3):
            torch.autograd.grad(single(), full, dfull)
        import numpy as np
        ts_f, ts_s = [], []
        for _ in range(args.reps):
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            with torch.no_grad():
                single()
            e[1].record()
            torch.autograd.grad(single(), full, dfull)
            e[2].record()
            e[2].synchronize()
            ts_f.append(e[0].elapsed_time(e[1]))
            ts_s.append(e[1].elapsed_time(e[2]))
        one_f, one_s = float(np.median(ts_f)), float(np.median(ts_s))
        print(f"| schedule | world | (Hq/Hkv, L, D) causal | fwd ms | fwd+bwd ms | 1 GPU fwd | 1 GPU fwd+bwd | "
              f"efficiency fwd | efficiency fwd+bwd |\n|---|---|---|---|---|---|---|---|---|")
        for schedule, f_ms, s_ms in rows:
            print(f"| {schedule} | {world} | ({Hq}/{Hkv}, {L}, {D}) {args.causal} | {f_ms:.3f} | {s_ms:.3f} | "
                  f"{one_f:.3f} | {one_s:.3f} | {one_f / (world * f_ms):.2f} | {one_s / (world * s_ms):.2f} |")
    dist.barrier()


def _spawned(rank, world, init, args):
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--spawn", type=int, default=0, help="start this many ranks here instead of under torchrun")
    args = ap.parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
    if args.spawn:
        import tempfile
        import torch.multiprocessing as mp
        init = f"file://{tempfile.mkdtemp()}/rendezvous"
        mp.start_processes(_spawned, args=(args.spawn, init, args), nprocs=args.spawn, join=True,
                           start_method="spawn")
        return 0
    import torch.distributed as dist
    dist.init_process_group("nccl")
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

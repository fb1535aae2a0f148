"""After decode and Linear-BN-softmax calls and release_memory(graphs=True): which live objects still hold device
memory (tests/test_memory.py::test_release_memory_frees_the_per_stream_caches found 32 MiB held). Prints every live
torch tensor and CuPy array of at least 1 MiB with the types of its referrers, and the workspace module's state.

    PYTHONPATH=. python3 bench/experiments/memory/who_holds.py
"""
import gc

import torch

import cupy_attn
from cupy_attn.runtime import workspace
from cupy_attn.torch import LinearBatchNormSoftmax

MiB = 1 << 20


def held(free0):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return (free0 - torch.cuda.mem_get_info()[0]) / MiB


def main():
    import cupy
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(8, 32, 1, 128, generator=g, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(8, 8, 8192, 128, generator=g, device="cuda", dtype=torch.float16) for _ in range(2))
    model = LinearBatchNormSoftmax(1024, 8192).cuda().half().eval()
    x = torch.randn(2048, 1024, generator=g, device="cuda", dtype=torch.float16)

    def calls():
        with torch.no_grad():
            cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, num_splits=8)
            model(x)

    calls()
    cupy_attn.release_memory(graphs=True)
    free0 = (torch.cuda.synchronize(), torch.cuda.empty_cache(), torch.cuda.mem_get_info()[0])[2]
    calls()
    print(f"after calls: {held(free0):.1f} MiB")
    cupy_attn.release_memory()
    print(f"after release_memory(): {held(free0):.1f} MiB")
    calls()
    print(f"after calls again: {held(free0):.1f} MiB")
    cupy_attn.release_memory(graphs=True)
    print(f"after release_memory(graphs=True): {held(free0):.1f} MiB")
    print("persistent:", list(workspace._PERSISTENT), "bound:", list(workspace._BOUND), "pools:",
          list(workspace._MEMPOOLS), "captured:", len(workspace._CAPTURED))
    print("torch reserved", torch.cuda.memory_reserved() / MiB, "allocated", torch.cuda.memory_allocated() / MiB,
          "cupy pool", cupy.get_default_memory_pool().total_bytes() / MiB)
    for o in gc.get_objects():
        try:
            big = (isinstance(o, torch.Tensor) and o.is_cuda and o.numel() * o.element_size() >= MiB) or \
                (isinstance(o, cupy.ndarray) and o.nbytes >= MiB)
        except Exception:
            continue
        if big and o is not q and o is not k and o is not v and o is not x:
            refs = [type(r).__name__ + (f"{sorted(r)[:6]}" if isinstance(r, dict) else "") for r in gc.get_referrers(o)]
            print(type(o).__name__, tuple(o.shape), "held by", refs[:6])


if __name__ == "__main__":
    main()

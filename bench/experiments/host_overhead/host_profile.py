"""cProfile of the host path: many small SDPA (fused and split) and Linear-BN-softmax calls, by own time."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import print_profile  # noqa: E402


def main():
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    qs = [x.float() for x in (q, k, v)]
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    vecs = [torch.randn(256, device="cuda") for _ in range(5)]
    rm, rv = vecs[0], vecs[1].abs() + 0.5
    cases = {
        "sdpa fused": lambda: cupy_attn.scaled_dot_product_attention(q, k, v),
        "sdpa split": lambda: cupy_attn.scaled_dot_product_attention(*qs),
        "lbs train": lambda: cupy_attn.linear_batchnorm_softmax(x, w, vecs[2].half(), rm, rv, vecs[3], vecs[4],
                                                                torch.ones(1, device="cuda"), training=True),
    }
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        print(f"===== {name}")
        print_profile(fn, 500)


if __name__ == "__main__":
    main()

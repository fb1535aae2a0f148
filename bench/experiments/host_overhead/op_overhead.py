"""Host cost of calling through a torch.library custom op instead of the Python function, on CPU (no GPU needed).

Two no-op custom ops with the schemas of cupy_attn::scaled_dot_product_attention and cupy_attn::linear_batchnorm_softmax
(same argument lists, same mutated arguments) return preallocated tensors, so the measured difference is the
dispatcher's alone: argument parsing against the schema, the Python custom-op trampoline, the mutation bookkeeping.

Run: PYTHONPATH=. python3 bench/experiments/host_overhead/op_overhead.py
Measured (2-core AMD EPYC, torch 2.13.0+cpu, Python 3.11, median of 7 repeats of 20000 calls), two runs:
    sdpa: Python function 0.07 / 0.12 µs, custom op 10.1 / 12.6 µs  -> +10.0 / +12.4 µs per call
    lbs:  Python function 0.05 / 0.05 µs, custom op 47.1 / 78.7 µs  -> +47 / +79 µs per call
Against a host-time budget of ~2 µs to spare, eager calls keep the direct path (cupy_attn/torch_ops.py).
"""
from __future__ import annotations

import statistics
import timeit

import torch

OUT = torch.empty(2, 4, 8, 8)
LSE = torch.empty(0)


@torch.library.custom_op("op_overhead::sdpa", mutates_args=())
def sdpa_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
            dropout_p: float, is_causal: str, scale: float | None, enable_gqa: bool, backend: str,
            return_lse: bool, allow_tf32: bool, workspace_bytes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    return OUT, LSE


def sdpa_py(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, return_lse, allow_tf32,
            workspace_bytes):
    return OUT, LSE


@torch.library.custom_op("op_overhead::lbs", mutates_args=("running_mean", "running_var", "num_batches_tracked"))
def lbs_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, running_mean: torch.Tensor | None,
           running_var: torch.Tensor | None, bn_weight: torch.Tensor | None, bn_bias: torch.Tensor | None,
           scale: torch.Tensor, training: bool, momentum: float | None, eps: float,
           num_batches_tracked: torch.Tensor | None, allow_tf32: bool | None) -> torch.Tensor:
    return OUT


def lbs_py(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, scale, training, momentum, eps,
           num_batches_tracked, allow_tf32):
    return OUT


def per_call_us(fn, number=20000, repeat=7) -> float:
    fn()
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main():
    q = torch.randn(2, 4, 8, 8)
    x, w, v = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    nbt = torch.zeros((), dtype=torch.long)
    sdpa_args = (q, q, q, None, 0.0, "", None, False, "auto", False, False, None)
    lbs_args = (x, w, v, v.clone(), v.clone(), v, v, torch.ones(1), True, 0.1, 1e-5, nbt, None)
    op_s, op_l = torch.ops.op_overhead.sdpa, torch.ops.op_overhead.lbs
    rows = [
        ("sdpa: Python function", lambda: sdpa_py(*sdpa_args)),
        ("sdpa: torch.ops custom op", lambda: op_s(*sdpa_args)),
        ("lbs: Python function", lambda: lbs_py(*lbs_args)),
        ("lbs: torch.ops custom op (3 mutated args)", lambda: op_l(*lbs_args)),
    ]
    t = {name: per_call_us(fn) for name, fn in rows}
    for name, us in t.items():
        print(f"{name:45s} {us:7.2f} µs/call")
    print(f"{'sdpa op overhead':45s} {t[rows[1][0]] - t[rows[0][0]]:7.2f} µs/call")
    print(f"{'lbs op overhead':45s} {t[rows[3][0]] - t[rows[2][0]]:7.2f} µs/call")
    print(f"torch {torch.__version__}")


if __name__ == "__main__":
    main()

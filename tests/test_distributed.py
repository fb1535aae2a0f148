"""cupy_attn.distributed on GPUs: ring attention over NCCL on 2 GPUs of one host (the nvidia-h200-x2 machines),
against a single-GPU call on the gathered sequence, forward and gradients, under the suite's error rule (the peer:
the same single-GPU call is the float64 reference's neighbour at the inputs' precision)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import cupy_attn  # noqa: E402
from cupy_attn import distributed as cp_dist  # noqa: E402
from _distributed import rank_errors, spawn  # noqa: E402

pytestmark = pytest.mark.gpu


def _worker(rank, world, init, failures, dtype_name, E, causal):
    import os
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    with rank_errors(rank, failures):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
        dtype = getattr(torch, dtype_name)
        g = torch.Generator("cuda").manual_seed(11)
        B, Hq, Hkv, L = 1, 8, 2, 1536
        q, k, v, dout = (torch.randn(B, H, L, E, generator=g, device="cuda").to(dtype) for H in (Hq, Hkv, Hkv, Hq))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        want = cupy_attn.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
        want_grads = torch.autograd.grad(want, full, dout)
        ref = [x.double().requires_grad_() for x in (q, k, v)]
        ref_out = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True)
        ref_grads = torch.autograd.grad(ref_out, ref, dout.double())
        shard = (lambda x: cp_dist.shard_sequence(x, rank, world))
        local = [shard(x).requires_grad_() for x in (q, k, v)]
        out = cp_dist.ring_attention(*local, is_causal=causal, enable_gqa=True)
        grads = torch.autograd.grad(out, local, shard(dout))
        for got, single, r, name in zip((out,) + grads, (want,) + want_grads, (ref_out,) + ref_grads,
                                        ("out", "dq", "dk", "dv")):
            r = shard(r).detach()
            err = (got.double() - r).abs().max().item()
            single_err = (shard(single).double() - r).abs().max().item()
            assert err <= 2 * single_err + 4 * torch.finfo(dtype).eps * r.abs().max().item(), \
                f"rank {rank} {name}: err {err:.3g} against the single-GPU call's {single_err:.3g}"


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("E", [128, 512])
@pytest.mark.parametrize("causal", [True, False])
def test_two_gpus_equal_one(dtype_name, E, causal, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machines)")
    spawn(_worker, 2, tmp_path, dtype_name, E, causal)


def _softcap_worker(rank, world, init, failures, window=None):
    import os
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    with rank_errors(rank, failures):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
        g = torch.Generator("cuda").manual_seed(12)
        q, k, v, dout = (torch.randn(1, H, 2048, 128, generator=g, device="cuda").bfloat16() * 2
                         for H in (8, 2, 2, 8))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        want = cupy_attn.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True, softcap=20.0,
                                                      window_size=window)
        want_grads = torch.autograd.grad(want, full, dout)
        shard = (lambda x: cp_dist.shard_sequence(x, rank, world))
        local = [shard(x).requires_grad_() for x in (q, k, v)]
        out = cp_dist.ring_attention(*local, is_causal=True, enable_gqa=True, softcap=20.0, window_size=window)
        grads = torch.autograd.grad(out, local, shard(dout))
        for got, single, name in zip((out,) + grads, (want,) + want_grads, ("out", "dq", "dk", "dv")):
            torch.testing.assert_close(got.float(), shard(single).float(), rtol=3e-2, atol=3e-2,
                                       msg=f"rank {rank} {name}")


@pytest.mark.parametrize("window", [None, (300, 0)])
def test_two_gpus_ring_with_softcap_and_window(window, tmp_path):
    """softcap (and a window: the pairs it touches run it as a mask_mod) on the ring over NCCL, forward and the
    Hopper backward, against the single-GPU call on the gathered sequence (bf16: the chunked merge rounds
    differently, so a tolerance of bf16's order)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machines)")
    spawn(_softcap_worker, 2, tmp_path, window)

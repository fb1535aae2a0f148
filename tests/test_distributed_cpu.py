"""cupy_attn.distributed on the CPU: ring attention over torch.distributed's gloo backend, world sizes 2, 3 and 4 in
subprocesses, against the call on the gathered sequence (the float64 reference path), forward and gradients; the
Ulysses (all-to-all) schedule on the same shards where the heads divide among the ranks."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import cupy_attn  # noqa: E402
from cupy_attn import distributed as cp_dist  # noqa: E402
from _distributed import rank_errors, spawn  # noqa: E402


def test_chunks_and_shards_round_trip():
    assert cp_dist.chunk_bounds(7, 3) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert cp_dist.rank_chunks(1, 3) == (1, 4) and cp_dist.rank_chunks(1, 3, zigzag=False) == (1,)
    x = torch.arange(2 * 11).reshape(1, 2, 11, 1)
    shards = [cp_dist.shard_sequence(x, r, 2) for r in range(2)]
    assert shards[0][0, 0, :, 0].tolist() == [0, 1, 2, 9, 10] and shards[1].shape[-2] == 6  # chunks 3, 3, 3, 2


# (world size, B, Hq, Hkv, L, E, causal, zigzag): odd lengths (chunks of different sizes), GQA, both layouts; the
# cases whose heads divide among the ranks run ulysses_attention too
CASES = [(2, 1, 2, 2, 12, 8, True, True), (2, 2, 4, 2, 13, 8, False, True), (3, 1, 4, 2, 17, 4, True, True),
         (3, 1, 3, 3, 9, 8, True, False), (4, 1, 2, 1, 23, 8, True, True), (4, 1, 8, 4, 8, 8, False, False),
         (4, 1, 8, 4, 21, 8, True, True)]


def _worker(rank, world, init, failures, case):
    with rank_errors(rank, failures):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        _, B, Hq, Hkv, L, E, causal, zigzag = case
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(B, H, L, E, generator=g) for H in (Hq, Hkv, Hkv))
        dout = torch.randn(B, Hq, L, E, generator=g)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        want, want_lse = cupy_attn.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=Hq != Hkv,
                                                                return_lse=True)
        want_grads = torch.autograd.grad(want, full, dout)
        shard = (lambda x: cp_dist.shard_sequence(x, rank, world, zigzag=zigzag))
        local = [shard(x).requires_grad_() for x in (q, k, v)]
        out, lse = cp_dist.ring_attention(*local, is_causal=causal, enable_gqa=Hq != Hkv, return_lse=True,
                                          zigzag=zigzag)
        np.testing.assert_allclose(out.detach().numpy(), shard(want).detach().numpy(), atol=2e-6)
        want_lse = cp_dist.shard_sequence(want_lse, rank, world, dim=-1, zigzag=zigzag)
        np.testing.assert_allclose(lse.numpy(), want_lse.numpy(), atol=2e-6)
        np.testing.assert_allclose(cp_dist.gather_sequence(out.detach(), zigzag=zigzag).numpy(),
                                   want.detach().numpy(), atol=2e-6)
        grads = torch.autograd.grad(out, local, shard(dout))
        for got, ref, name in zip(grads, want_grads, ("dq", "dk", "dv")):
            np.testing.assert_allclose(got.numpy(), shard(ref).numpy(), atol=2e-5, err_msg=f"rank {rank} {name}")
        if Hq % world == 0 and Hkv % world == 0:  # the head-parallel schedule, on the same shards
            local = [shard(x).requires_grad_() for x in (q, k, v)]
            out, lse = cp_dist.ulysses_attention(*local, is_causal=causal, enable_gqa=Hq != Hkv, return_lse=True,
                                                 zigzag=zigzag)
            np.testing.assert_allclose(out.detach().numpy(), shard(want).detach().numpy(), atol=2e-6)
            np.testing.assert_allclose(lse.numpy(), want_lse.numpy(), atol=2e-6)
            grads = torch.autograd.grad(out, local, shard(dout))
            for got, ref, name in zip(grads, want_grads, ("dq", "dk", "dv")):
                np.testing.assert_allclose(got.numpy(), shard(ref).numpy(), atol=2e-5,
                                           err_msg=f"ulysses rank {rank} {name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "w{}_L{}_{}{}{}".format(
    c[0], c[4], "causal" if c[6] else "full", "_gqa" if c[2] != c[3] else "", "" if c[7] else "_contiguous"))
def test_ring_attention_equals_the_gathered_call(case, tmp_path):
    spawn(_worker, case[0], tmp_path, case)


def test_schedule_rule():
    assert cp_dist.choose_schedule(32, 8, 128, 128, 2)[0] == "ring"       # GQA: K/V small, the ring moves less
    assert cp_dist.choose_schedule(16, 16, 128, 128, 4)[0] == "ulysses"   # MHA on 4 ranks: the all-to-alls move less
    assert cp_dist.choose_schedule(12, 4, 64, 64, 8)[0] == "ring"         # heads not divisible
    assert cp_dist.choose_schedule(8, 8, 64, 64, 2, window=True)[0] == "ulysses"
    assert cp_dist.choose_schedule(8, 8, 64, 64, 3, window=True)[0] == "ring"  # heads not divisible: the ring
    assert cp_dist.choose_schedule(12, 4, 64, 64, 8, softcap=True)[0] == "ring"  # the ring takes softcap


def test_shard_length_mismatch_is_a_value_error(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    try:
        q = torch.randn(1, 2, 5, 4)
        out = cp_dist.ring_attention(q, q, q, is_causal=True)  # one rank: the whole sequence
        want = cupy_attn.scaled_dot_product_attention(q, q, q, is_causal=True)
        np.testing.assert_allclose(out.numpy(), want.numpy(), atol=2e-6)
        with pytest.raises(ValueError, match="must hold the same rows"):
            cp_dist.ring_attention(q, q[:, :, :4], q[:, :, :4])
        got = cp_dist.context_parallel_attention(q, q, q, is_causal=True, window_size=(2, 0))  # Ulysses on 1 rank
        want = cupy_attn.scaled_dot_product_attention(q, q, q, is_causal=True, window_size=(2, 0))
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-6)
        with pytest.raises(ValueError, match="schedule must be"):
            cp_dist.context_parallel_attention(q, q, q, schedule="tree")
    finally:
        dist.destroy_process_group()


def _dropout_worker(rank, world, init, failures):
    with rank_errors(rank, failures):
        from cupy_attn.attention import dropout as dr
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        B, Hq, Hkv, L, E, p = 1, 4, 2, 14, 8, 0.25
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(B, H, L, E, generator=g) for H in (Hq, Hkv, Hkv))
        dout = torch.randn(B, Hq, L, E, generator=g)
        shard = (lambda x, dim=-2: cp_dist.shard_sequence(x, rank, world, dim=dim))
        local = [shard(x).requires_grad_() for x in (q, k, v)]
        out = cp_dist.ring_attention(*local, is_causal=True, enable_gqa=True, dropout_p=p,
                                     generator=torch.Generator().manual_seed(50 + rank))
        grads = torch.autograd.grad(out, local, shard(dout))
        # the pairs' rng, drawn again in the same order from the same seed, and every rank's
        ring = cp_dist._Ring(None, local[0].shape[-2], "cpu", True, True)
        _, _, rngs = cp_dist._forward(ring, *(x.detach() for x in local), E ** -0.5, True, p,
                                      torch.Generator().manual_seed(50 + rank))
        mine = {key: dr.values(r) for key, r in rngs.items()}
        every = [None] * world
        dist.all_gather_object(every, mine)
        keep = np.ones((B, Hq, L, L), dtype=bool)
        for pairs in every:
            for (cq, ck), (seed, offset) in pairs.items():
                (r0, r1), (c0, c1) = ring.bounds[cq], ring.bounds[ck]
                keep[:, :, r0:r1, c0:c1] = dr.keep_mask(torch.tensor([seed, offset]), (B, Hq, r1 - r0, c1 - c0), p)
        ref = [x.double().requires_grad_() for x in (q, k, v)]
        s = (ref[0] @ ref[1].repeat_interleave(2, 1).transpose(-1, -2)) * E ** -0.5
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        probs = torch.softmax(s, -1) * torch.from_numpy(keep) / (1 - p)
        want = probs @ ref[2].repeat_interleave(2, 1)
        want_grads = torch.autograd.grad(want, ref, dout.double())
        np.testing.assert_allclose(out.detach().numpy(), shard(want).detach().numpy(), atol=2e-6)
        for got, r, name in zip(grads, want_grads, ("dq", "dk", "dv")):
            np.testing.assert_allclose(got.numpy(), shard(r).numpy(), atol=2e-5, err_msg=f"rank {rank} {name}")


def test_ring_dropout_applies_each_pairs_mask_forward_and_backward(tmp_path):
    """Dropout on the ring: each (query chunk, key chunk) pair's keep mask, assembled into the whole sequence's, gives
    the same output and gradients as one float64 computation with that mask (world size 2, causal, GQA)."""
    spawn(_dropout_worker, 2, tmp_path)


def _softcap_worker(rank, world, init, failures):
    with rank_errors(rank, failures):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        g = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(1, H, 19, 8, generator=g) * 3 for H in (4, 2, 2))
        dout = torch.randn(1, 4, 19, 8, generator=g)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        want = cupy_attn.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True, softcap=2.0)
        want_grads = torch.autograd.grad(want, full, dout)
        shard = (lambda x: cp_dist.shard_sequence(x, rank, world))
        local = [shard(x).requires_grad_() for x in (q, k, v)]
        out = cp_dist.context_parallel_attention(*local, is_causal=True, enable_gqa=True, softcap=2.0,
                                                 schedule="ring")
        np.testing.assert_allclose(out.detach().numpy(), shard(want).detach().numpy(), atol=2e-6)
        for got, ref in zip(torch.autograd.grad(out, local, shard(dout)), want_grads):
            np.testing.assert_allclose(got.numpy(), shard(ref).numpy(), atol=2e-5)
        with pytest.raises(ValueError, match="softcap with dropout_p"):
            cp_dist.ring_attention(*local, enable_gqa=True, softcap=2.0, dropout_p=0.1)


def test_ring_attention_with_softcap(tmp_path):
    """softcap on the ring (every chunk pair's scores capped, the backward's (1 − t²) per pair) equals the dense call
    on the gathered sequence, forward and gradients, on 3 ranks."""
    spawn(_softcap_worker, 3, tmp_path)


def _window_worker(rank, world, init, failures):
    with rank_errors(rank, failures):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        g = torch.Generator().manual_seed(13)
        q, k, v = (torch.randn(1, H, 23, 8, generator=g) for H in (2, 2, 2))
        dout = torch.randn(1, 2, 23, 8, generator=g)
        assert cp_dist.choose_schedule(2, 2, 8, 8, world, window=True)[0] == "ring"
        for causal, window in ((True, (4, 0)), (False, (3, 2)), (False, (None, 1))):
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            want = cupy_attn.scaled_dot_product_attention(*full, is_causal=causal, window_size=window, softcap=5.0)
            want_grads = torch.autograd.grad(want, full, dout)
            shard = (lambda x: cp_dist.shard_sequence(x, rank, world))
            local = [shard(x).requires_grad_() for x in (q, k, v)]
            out = cp_dist.ring_attention(*local, is_causal=causal, window_size=window, softcap=5.0)
            np.testing.assert_allclose(out.detach().numpy(), shard(want).detach().numpy(), atol=2e-6,
                                       err_msg=f"rank {rank} {causal} {window}")
            for got, ref in zip(torch.autograd.grad(out, local, shard(dout)), want_grads):
                np.testing.assert_allclose(got.numpy(), shard(ref).numpy(), atol=2e-5,
                                           err_msg=f"rank {rank} {causal} {window}")
        with pytest.raises(ValueError, match="window_size with dropout_p"):
            cp_dist.ring_attention(*local, window_size=(4, 0), dropout_p=0.1)


def test_ring_attention_with_a_window(tmp_path):
    """A window on the ring (3 ranks, heads not divisible: the ring; pairs wholly outside skipped, the others a
    mask_mod with the pair's global offset), with softcap, causal or not, equals the gathered call, forward and
    gradients."""
    spawn(_window_worker, 3, tmp_path)


def _ulysses_dropout_worker(rank, world, init, failures):
    with rank_errors(rank, failures):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        g = torch.Generator().manual_seed(17)
        q, k, v = (torch.randn(1, 4, 10, 8, generator=g) for _ in range(3))
        shard = (lambda x: cp_dist.shard_sequence(x, rank, world))
        local = [shard(x).requires_grad_() for x in (q, k, v)]
        runs = []
        for _ in range(2):  # the same generator state: the same masks, the same result
            gen = torch.Generator().manual_seed(100 + rank)
            out = cp_dist.ulysses_attention(*local, is_causal=True, dropout_p=0.3, generator=gen, window_size=(3, 0))
            runs.append((out, torch.autograd.grad(out.sum(), local)))
        np.testing.assert_array_equal(runs[0][0].detach().numpy(), runs[1][0].detach().numpy())
        for a, b in zip(runs[0][1], runs[1][1]):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        zero = cp_dist.ulysses_attention(*local, is_causal=True, dropout_p=1.0)
        assert torch.all(zero == 0)
        plain = cp_dist.ulysses_attention(*local, is_causal=True, window_size=(3, 0))
        assert not torch.allclose(runs[0][0], plain)  # the masks took effect
        auto = cp_dist.context_parallel_attention(*local, is_causal=True, dropout_p=0.3, window_size=(3, 0),
                                                  generator=torch.Generator().manual_seed(100 + rank))
        np.testing.assert_array_equal(auto.detach().numpy(), runs[0][0].detach().numpy())  # auto: Ulysses


def test_ulysses_dropout(tmp_path):
    """Dropout on the Ulysses schedule (the dense call's, each rank's heads with its generator; with a window, which
    the ring cannot take with dropout): reproducible from the generator's state, forward and gradients; p = 1 gives
    0; context_parallel_attention takes Ulysses for dropout with a window."""
    spawn(_ulysses_dropout_worker, 2, tmp_path)

"""Context-parallel attention over torch.distributed: ring attention on sequence shards, forward and backward.

    shard_sequence / gather_sequence   a sequence split into (zig-zag) chunks per rank, and back
    ring_attention                     attention of every rank's query shard against the whole sequence's keys
                                       (softcap, windows and dropout too)
    ulysses_attention                  the same by two all-to-alls: each rank attends the whole sequence for H / N
                                       heads (DeepSpeed-Ulysses), with windows and softcap
    context_parallel_attention         either, by choose_schedule's rule (which says why)

Each rank holds a shard of the sequence (queries, keys and values alike). Keys and values travel around the ring of
ranks (rank r sends to r + 1 and receives from r − 1, NCCL or gloo point-to-point through the group's ProcessGroup)
while every rank attends its queries to the shard it holds; the partial results are merged by their log-sum-exp
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the lse merge of merge_attention_states). With
``zigzag`` (the default) the sequence is cut into 2N chunks and rank r holds chunks r and 2N − 1 − r, so that under a
causal mask every rank has the same work (the load balancing of ring-flash-attn's zigzag and of Llama 3's context
parallelism). The backward runs the same ring: dQ stays local, dK and dV accumulate in fp32 beside the keys they
belong to and travel with them until they are home, each step's partial gradients computed from the global out and
lse (FlashAttention-2's backward needs nothing else).

torch tensors only (torch.distributed), CUDA (our kernels) or CPU (the float64 reference, for checking). The ring
forward and the backward issue each step's K/V transfer before that step's compute and wait for it after; the
backward's dK and dV follow their keys after each step's compute. Windows in the ring run as a mask_mod on the chunk
pairs they touch (pairs wholly outside are skipped). Not yet: a window or softcap with dropout on the ring (Ulysses
has them), sinks and ALiBi.
"""
from __future__ import annotations

import functools
import math
import sys

import numpy as np

from . import reference

__all__ = ["chunk_bounds", "shard_sequence", "gather_sequence", "ring_attention", "ulysses_attention",
           "choose_schedule", "context_parallel_attention"]


def chunk_bounds(seqlen: int, world_size: int, zigzag: bool = True) -> list[tuple[int, int]]:
    """[start, end) of the sequence's chunks: 2·world_size of them with ``zigzag``, world_size without, as equal as
    they come (the first ``seqlen % n`` chunks one longer).

    >>> chunk_bounds(10, 2)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    >>> chunk_bounds(10, 2, zigzag=False)
    [(0, 5), (5, 10)]
    """
    n = 2 * world_size if zigzag else world_size
    sizes = [seqlen // n + (i < seqlen % n) for i in range(n)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [(int(starts[i]), int(starts[i + 1])) for i in range(n)]


def rank_chunks(rank: int, world_size: int, zigzag: bool = True) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in the order of its shard: (rank, 2N − 1 − rank), or (rank,)."""
    return (rank, 2 * world_size - 1 - rank) if zigzag else (rank,)


def _group_info(group):
    import torch.distributed as dist
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x, rank: int, world_size: int, *, dim: int = -2, zigzag: bool = True):
    """Rank ``rank``'s shard of ``x`` along ``dim``: its chunks (:func:`rank_chunks` of :func:`chunk_bounds`)
    concatenated. A torch tensor (or anything with ``narrow`` and ``torch.cat``); a copy."""
    torch = sys.modules["torch"]
    bounds = chunk_bounds(x.shape[dim], world_size, zigzag)
    return torch.cat([x.narrow(dim, bounds[c][0], bounds[c][1] - bounds[c][0])
                      for c in rank_chunks(rank, world_size, zigzag)], dim=dim).contiguous()


def gather_sequence(x_local, *, group=None, dim: int = -2, zigzag: bool = True):
    """The whole sequence from every rank's shard (the inverse of :func:`shard_sequence`), on every rank: an
    all_gather of the shards (padded to the longest), unpadded and put back in sequence order."""
    import torch.distributed as dist
    torch = sys.modules["torch"]
    rank, n = _group_info(group)
    dim = dim % x_local.dim()
    lengths = _all_lengths(x_local.shape[dim], group, x_local.device)
    longest = max(lengths)
    pad = list(x_local.shape)
    pad[dim] = longest - x_local.shape[dim]
    padded = torch.cat([x_local, x_local.new_zeros(pad)], dim=dim) if pad[dim] else x_local.contiguous()
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    seqlen = sum(lengths)
    bounds = chunk_bounds(seqlen, n, zigzag)
    pieces = {}
    for r, part in enumerate(parts):
        at = 0
        for c in rank_chunks(r, n, zigzag):
            size = bounds[c][1] - bounds[c][0]
            pieces[c] = part.narrow(dim, at, size)
            at += size
    return torch.cat([pieces[c] for c in range(len(bounds))], dim=dim)


def _all_lengths(length: int, group, device) -> list[int]:
    import torch.distributed as dist
    torch = sys.modules["torch"]
    _, n = _group_info(group)
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


class _Ring:
    """One call's ring: who sends to whom, the chunk layout of every rank's shard, the causal rule between chunks."""

    def __init__(self, group, seqlen_local: int, device, zigzag: bool, causal: bool, window=(None, None)):
        rank, n = _group_info(group)
        self.group, self.rank, self.n, self.zigzag, self.causal = group, rank, n, zigzag, causal
        self.window = window  # (left, right) in global positions, None: unbounded on that side
        lengths = _all_lengths(seqlen_local, group, device)
        self.bounds = chunk_bounds(sum(lengths), n, zigzag)
        for r in range(n):
            want = sum(self.bounds[c][1] - self.bounds[c][0] for c in rank_chunks(r, n, zigzag))
            if lengths[r] != want:
                raise ValueError(f"rank {r}'s shard holds {lengths[r]} rows along the sequence axis; a sequence of "
                                 f"{sum(lengths)} cut by shard_sequence(zigzag={zigzag}) gives it {want}")

    def chunks(self, r: int) -> list[tuple[int, int, int]]:
        """(chunk index, start, length) of rank r's chunks within its shard."""
        out, at = [], 0
        for c in rank_chunks(r, self.n, self.zigzag):
            size = self.bounds[c][1] - self.bounds[c][0]
            out.append((c, at, size))
            at += size
        return out

    def length(self, r: int) -> int:
        return sum(size for _, _, size in self.chunks(r))

    def visibility(self, cq: int, ck: int):
        """How query chunk cq sees key chunk ck: None (not at all), False (every key), or "top_left" (the same
        chunk under a causal mask: its own causal triangle); with a window, None also when every key of ck lies
        outside every row's window."""
        if self.causal and ck > cq:
            return None
        left, right = self.window
        (q0, q1), (k0, k1) = self.bounds[cq], self.bounds[ck]
        if (left is not None and k1 - 1 < q0 - left) or (right is not None and k0 > q1 - 1 + right):
            return None
        if not self.causal:
            return False
        return "top_left" if ck == cq else False

    def window_of(self, cq: int, ck: int):
        """The window mod's aux for the pair (cq, ck), or None without a window: [global query start − global key
        start, left, right] (int32; 2^30 for an unbounded side)."""
        left, right = self.window
        if left is None and right is None:
            return None
        big = 1 << 30
        return [self.bounds[cq][0] - self.bounds[ck][0], big if left is None else left, big if right is None else right]

    def exchange(self, tensors: list, sender: int):
        """Send ``tensors`` to rank + 1 and receive the same-shaped ones (but for the sequence axis, rank
        ``sender``'s length) from rank − 1; returns (requests, received buffers)."""
        import torch.distributed as dist
        torch = sys.modules["torch"]
        bufs = []
        for t in tensors:
            shape = list(t.shape)
            shape[-2] = self.length(sender)
            bufs.append(torch.empty(shape, dtype=t.dtype, device=t.device))
        nxt, prv = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.n))
        ops = [dist.P2POp(dist.isend, t.contiguous(), ranks[nxt], self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, ranks[prv], self.group) for b in bufs]
        return dist.batch_isend_irecv(ops), bufs


@functools.cache
def _window_mod():
    """The ring's window as a mask_mod: key j of the pair's key chunk is visible to query i of its query chunk when
    −right ≤ (i + d) − j ≤ left, d = the chunks' global start difference (aux.win = [d, left, right])."""
    from .attention.mods import AttentionMod
    return AttentionMod(
        mask_mod="const long long rel = static_cast<long long>(q_idx) + aux.win[0] - kv_idx;\n"
                 "return rel <= aux.win[1] && rel >= -static_cast<long long>(aux.win[2]);",
        reference_mask_mod=lambda b, h, i, j, aux: ((i + int(aux.win[0]) - j) <= int(aux.win[1]))
        & ((i + int(aux.win[0]) - j) >= -int(aux.win[2])))


def _window_aux(win, device):
    torch = sys.modules["torch"]
    return {"win": torch.tensor(win, dtype=torch.int32, device=device)}


def _attend(q, k, v, causal, scale, enable_gqa, dropout_p=0.0, rng=None, softcap=None, win=None):
    """(out fp32, lse fp32) of one (query chunk, key chunk) pair: our kernels on CUDA, the float64 reference on CPU.
    dropout_p > 0: the pair's keep mask comes from ``rng`` (the call's int64 (seed, offset), attention/dropout.py).
    softcap: as the dense call's (per score, so the same on every pair). win: the pair's window (_Ring.window_of),
    applied as a mask_mod (_window_mod), or None."""
    torch = sys.modules["torch"]
    if win is not None:  # the window as a mod (no dropout with a window: ring_attention refuses it)
        from .attention.sdpa import scaled_dot_product_attention
        out, lse = scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=causal, scale=scale,
                                                enable_gqa=enable_gqa, softcap=softcap, score_mod=_window_mod(),
                                                aux=_window_aux(win, q.device), return_lse=True)
        return out.float(), lse.float()
    if q.is_cuda:
        from .attention.sdpa import forward
        out, lse = forward(q, k, v, None, is_causal=causal, scale=scale, enable_gqa=enable_gqa, workspace_bytes=None,
                           allow_tf32=False, dropout_p=dropout_p, rng=rng, variants=(None, softcap, None, None))
        return out.float(), lse.float()
    from .attention import dropout
    mask = None if not dropout_p else dropout.keep_mask(rng, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]),
                                                        dropout_p)
    out, lse = reference.scaled_dot_product_attention(
        *(x.detach().double().numpy() for x in (q, k, v)), is_causal=causal, scale=scale, enable_gqa=enable_gqa,
        return_lse=True, dropout_p=dropout_p, dropout_mask=mask, softcap=softcap)
    return torch.from_numpy(out).float(), torch.from_numpy(lse).float()


def _merge(acc, part):
    """Merge two (out fp32, lse fp32) by their lse (merge_attention_states' formula, in torch ops)."""
    torch = sys.modules["torch"]
    if acc is None:
        return part
    (oa, la), (ob, lb) = acc, part
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    s = wa + wb
    lse = torch.where(s > 0, m_safe + torch.log(s), torch.full_like(m, -math.inf))
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    return (oa * (wa * inv)[..., None] + ob * (wb * inv)[..., None]), lse


def _grads(q, k, v, out, lse, dout, causal, scale, enable_gqa, dropout_p=0.0, rng=None, softcap=None, win=None):
    """(dq, dk, dv) fp32 of one (query chunk, key chunk) pair from the whole call's out and lse (dropout: the pair's
    forward rng, so the same keep mask; softcap: its factor (1 − t²) in dS, as the dense backward's; win: the
    pair's window as the forward's mask_mod)."""
    torch = sys.modules["torch"]
    if win is not None and q.is_cuda:
        from .attention import autograd, checks
        p = checks.check_sdpa(q.detach(), k.detach(), v.detach(), None, 0.0, causal, scale, enable_gqa, "auto", None,
                              None, softcap, None, None, score_mod=_window_mod(), aux=_window_aux(win, q.device))
        dq, dk, dv, _ = autograd.problem_grads(p, q, k, v, None, out, lse.contiguous(), dout, need_mask_grad=False)
        return dq.float(), dk.float(), dv.float()
    if q.is_cuda:
        from .attention import autograd
        dq, dk, dv, _ = autograd.grad_inputs(q, k, v, None, out, lse.contiguous(), dout, is_causal=causal,
                                             scale=scale, enable_gqa=enable_gqa, need_mask_grad=False,
                                             dropout_p=dropout_p, rng=rng, variants=(None, softcap, None, None))
        return dq.float(), dk.float(), dv.float()
    from .attention import dropout
    mask = None if not dropout_p else dropout.keep_mask(rng, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]),
                                                        dropout_p)
    mask_mod = None
    if win is not None:
        form = _window_mod().reference_mask_mod
        aux = type("Aux", (), {"win": np.asarray(win)})
        mask_mod = (lambda b, h, i, j: form(b, h, i, j, aux))
    g = reference.scaled_dot_product_attention_backward(
        *(x.detach().double().numpy() for x in (q, k, v, out, lse, dout)), causal, scale, enable_gqa,
        dropout_p=dropout_p, dropout_mask=mask, softcap=softcap, mask_mod=mask_mod)
    return tuple(torch.from_numpy(x).float() for x in g[:3])


def _forward(ring: _Ring, q, k, v, scale, enable_gqa, dropout_p=0.0, generator=None, softcap=None):
    """(out in q's dtype, lse fp32, rngs) of the local queries against every rank's keys; rngs: {(query chunk, key
    chunk): the pair's rng} with dropout (each pair draws its own from ``generator``), else empty."""
    from .attention import dropout
    torch = sys.modules["torch"]
    rngs = {}
    acc = {c: None for c, _, _ in ring.chunks(ring.rank)}
    kv = [k, v]
    for step in range(ring.n):
        holder = (ring.rank - step) % ring.n
        pending = None
        if step + 1 < ring.n:
            pending = ring.exchange(kv, (holder - 1) % ring.n)
        for cq, qs, ql in ring.chunks(ring.rank):
            for ck, ks, kl in ring.chunks(holder):
                vis = ring.visibility(cq, ck)
                if vis is None or ql == 0 or kl == 0:
                    continue
                if dropout_p:
                    rngs[cq, ck] = dropout.torch_draw(q.device, generator)
                part = _attend(q.narrow(-2, qs, ql), kv[0].narrow(-2, ks, kl), kv[1].narrow(-2, ks, kl), vis, scale,
                               enable_gqa, dropout_p, rngs.get((cq, ck)), softcap, ring.window_of(cq, ck))
                acc[cq] = _merge(acc[cq], part)
        if pending is not None:
            for req in pending[0]:
                req.wait()
            kv = pending[1]
    outs, lses = [], []
    B, H, Ev = q.shape[0], q.shape[1], v.shape[-1]
    for cq, _, ql in ring.chunks(ring.rank):
        if acc[cq] is None:  # no key visible to these rows (an empty chunk): out 0, lse -inf
            acc[cq] = (q.new_zeros((B, H, ql, Ev), dtype=torch.float32),
                       q.new_full((B, H, ql), -math.inf, dtype=torch.float32))
        outs.append(acc[cq][0])
        lses.append(acc[cq][1])
    return torch.cat(outs, -2).to(q.dtype), torch.cat(lses, -1), rngs


def _backward(ring: _Ring, q, k, v, out, lse, dout, scale, enable_gqa, dropout_p=0.0, rngs=None, softcap=None):
    """(dq, dk, dv) of the local shards: the ring again. Each step's K/V transfer (for the next step) is issued
    before the step's compute, as the forward's; dK and dV (fp32) follow their keys one step behind, sent after the
    compute that added to them, and after n sends they are back with the keys' owner."""
    torch = sys.modules["torch"]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
           torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
    for step in range(ring.n):
        holder = (ring.rank - step) % ring.n
        pending = ring.exchange(kv, (holder - 1) % ring.n) if step + 1 < ring.n else None
        for cq, qs, ql in ring.chunks(ring.rank):
            for ck, ks, kl in ring.chunks(holder):
                vis = ring.visibility(cq, ck)
                if vis is None or ql == 0 or kl == 0:
                    continue
                rows = (lambda x: x.narrow(-2, qs, ql))
                g = _grads(rows(q), kv[0].narrow(-2, ks, kl), kv[1].narrow(-2, ks, kl), rows(out),
                           lse.narrow(-1, qs, ql), rows(dout), vis, scale, enable_gqa, dropout_p,
                           (rngs or {}).get((cq, ck)), softcap, ring.window_of(cq, ck))
                dq.narrow(-2, qs, ql).add_(g[0])
                dkv[0].narrow(-2, ks, kl).add_(g[1])
                dkv[1].narrow(-2, ks, kl).add_(g[2])
        if ring.n > 1:
            reqs, dkv = ring.exchange(dkv, (holder - 1) % ring.n)
            for req in reqs:
                req.wait()
        if pending is not None:
            for req in pending[0]:
                req.wait()
            kv = pending[1]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


@functools.cache
def _function():
    torch = sys.modules["torch"]

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(fctx, q, k, v, ring, scale, enable_gqa, dropout_p, generator, softcap):
            out, lse, rngs = _forward(ring, q.detach(), k.detach(), v.detach(), scale, enable_gqa, dropout_p,
                                      generator, softcap)
            fctx.save_for_backward(q, k, v, out, lse)
            fctx.ring, fctx.scale, fctx.enable_gqa, fctx.dropout = ring, scale, enable_gqa, (dropout_p, rngs)
            fctx.softcap = softcap
            fctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(fctx, dout, _dlse):
            q, k, v, out, lse = fctx.saved_tensors
            dq, dk, dv = _backward(fctx.ring, q, k, v, out, lse, dout.contiguous(), fctx.scale, fctx.enable_gqa,
                                   *fctx.dropout, softcap=fctx.softcap)
            return dq, dk, dv, None, None, None, None, None, None

    return RingAttention


def ring_attention(q, k, v, *, group=None, is_causal=False, scale=None, enable_gqa=False, return_lse=False,
                   zigzag=True, dropout_p=0.0, generator=None, softcap=None, window_size=None):
    """Attention of this rank's query shard against the keys of every rank's shard, as if on the whole sequence:

        out_i = Σ_j softmax_j(s_ij) v_j over all keys j of the sequence (j ≤ i with is_causal),
        lse_i = log Σ_j exp(s_ij),   s_ij = scale · q_i·k_j, or softcap · tanh(scale · q_i·k_j / softcap),

    for the rows i this rank holds; the same result, row for row, as :func:`cupy_attn.scaled_dot_product_attention`
    on the gathered sequence (torch's top-left causal mask; the sequence is one: L = S).

    Shapes: q (B, Hq, L_local, E), k (B, Hkv, L_local, E), v (B, Hkv, L_local, Ev) torch tensors, every rank's
    shard cut by :func:`shard_sequence` with the same ``zigzag`` (rank r: chunks r and 2N − 1 − r of 2N, or chunk r
    of N); Hq a multiple of Hkv with enable_gqa. float16, bfloat16 or float32 on CUDA (our kernels); CPU tensors run
    the float64 reference. group: the torch.distributed process group (None: the default one). Differentiable in q,
    k and v (torch autograd); lse is not. dropout_p: torch's attention dropout; each (query chunk, key chunk) pair of
    the ring draws its own rng pair from ``generator`` (a torch.Generator of q's device, or None: torch's default) and
    the backward applies the same keep masks (the masks differ from a single call's on the gathered sequence, which
    draws one pair; the distribution is the same).

    Returns out (B, Hq, L_local, Ev) in q's dtype, or (out, lse (B, Hq, L_local) float32).

    Raises ValueError when a rank's shard length is not what shard_sequence gives for the gathered length, or shapes
    disagree; ValueError for dropout_p outside [0, 1], for softcap with dropout_p > 0 (no backward kernel has
    both) and for a window with dropout_p > 0. softcap: as the dense call's (a float > 0, or None / 0). window_size:
    (left, right) in positions of the whole sequence, as the dense call's with L = S: key j visible to query i when
    i − left ≤ j ≤ i + right; chunk pairs wholly outside every row's window are skipped, the others run the window
    as a mask_mod (cupy_attn.AttentionMod, the pair's global offset in its aux), forward and backward.
    Algorithm: ring attention (Liu et al. 2023) with zig-zag load balancing; partial results merged by lse.
    """
    torch = sys.modules["torch"]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be (B, H, L_local, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != q.shape[-2]:
        raise ValueError(f"q, k and v must hold the same rows of the sequence (axis 2), got {q.shape[-2]}, "
                         f"{k.shape[-2]}, {v.shape[-2]}")
    if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"q's heads (axis 1: {q.shape[1]}) must equal k's ({k.shape[1]}), or be a multiple of them "
                         f"with enable_gqa=True")
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0 \
                or not math.isfinite(softcap):
            raise ValueError(f"softcap must be a finite number >= 0 (0 or None: off), got {softcap!r}")
        softcap = float(softcap) or None
    if softcap is not None and float(dropout_p) > 0:
        raise ValueError("softcap with dropout_p > 0: no backward kernel has both")
    window = reference.window_bounds(window_size)
    if window != (None, None) and float(dropout_p) > 0:
        raise ValueError("window_size with dropout_p > 0: the ring runs windows as a mask_mod, which has no dropout")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    ring = _Ring(group, q.shape[-2], q.device, zigzag, bool(is_causal), window)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = _function().apply(q, k, v, ring, scale, bool(enable_gqa), float(dropout_p), generator, softcap)
    else:
        out, lse, _ = _forward(ring, q, k, v, scale, bool(enable_gqa), float(dropout_p), generator, softcap)
    return (out, lse) if return_lse else out


@functools.cache
def _a2a_function():
    """all_to_all_single of flat tensors as a torch.autograd.Function: its backward is the reverse exchange."""
    torch = sys.modules["torch"]

    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x, send, recv, group):
            import torch.distributed as dist
            out = x.new_empty(sum(recv))
            dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
            fctx.send, fctx.recv, fctx.group = send, recv, group
            return out

        @staticmethod
        def backward(fctx, grad):
            return AllToAll.apply(grad.contiguous(), fctx.recv, fctx.send, fctx.group), None, None, None

    return AllToAll


def _seq_to_heads(x, lengths, group):
    """(B, H, L_local, D) on every rank -> (B, H / N, Σ L_r, D): this rank's head group over every rank's rows, in
    rank order (an all-to-all; differentiable)."""
    rank, n = _group_info(group)
    B, H, L, D = x.shape
    hg = H // n
    send = [B * hg * L * D] * n
    recv = [B * hg * lr * D for lr in lengths]
    flat = x.reshape(B, n, hg, L, D).transpose(0, 1).reshape(-1)  # head group major
    got = _a2a_function().apply(flat, tuple(send), tuple(recv), group)
    parts = [p.reshape(B, hg, lr, D) for p, lr in zip(got.split(recv), lengths)]
    return sys.modules["torch"].cat(parts, dim=2)


def _heads_to_seq(x, lengths, group):
    """The inverse of :func:`_seq_to_heads`: (B, H / N, Σ L_r, D) -> (B, H, L_local, D)."""
    torch = sys.modules["torch"]
    rank, n = _group_info(group)
    B, hg, _, D = x.shape
    send = [B * hg * lr * D for lr in lengths]
    recv = [B * hg * lengths[rank] * D] * n
    flat = torch.cat([p.reshape(-1) for p in x.split(lengths, dim=2)])
    got = _a2a_function().apply(flat, tuple(send), tuple(recv), group)
    return got.reshape(n, B, hg, lengths[rank], D).transpose(0, 1).reshape(B, n * hg, lengths[rank], D)


def ulysses_attention(q, k, v, *, group=None, is_causal=False, scale=None, enable_gqa=False, return_lse=False,
                      zigzag=True, window_size=None, softcap=None, dropout_p=0.0, generator=None):
    """The result of :func:`ring_attention` (same shards, same math) by DeepSpeed-Ulysses' head-parallel schedule
    (Jacobs et al. 2023): an all-to-all gives each rank every row of the sequence for H / N of the heads, the rank runs
    :func:`cupy_attn.scaled_dot_product_attention` on them (so windows and softcap are available, in its kernels),
    and a second all-to-all brings the rows back to their shards. Each all-to-all moves the shards once (q, k, v
    out; out back): fewer, larger messages than the ring's N − 1 steps, but N may not exceed the heads.

    Shapes and dtypes as ring_attention's; Hq and Hkv must both be multiples of the world size. window_size and
    softcap as the dense call's (relative to the whole sequence). dropout_p, generator: the dense call's dropout on
    this rank's heads (its keep mask drawn from ``generator`` on each rank: the masks differ from one call's on the
    gathered sequence, the distribution is the same; the backward applies the same masks). Differentiable in q, k
    and v (the all-to-alls' backward is the reverse exchange; the attention's is the dense call's). Returns out, or
    (out, lse) with lse (B, Hq, L_local) float32 (no gradient).

    Raises ValueError for heads that do not divide among the ranks and for shards of the wrong length.
    """
    torch = sys.modules["torch"]
    from .attention.sdpa import scaled_dot_product_attention
    rank, n = _group_info(group)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be (B, H, L_local, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(f"ulysses_attention: the heads (q axis 1: {q.shape[1]}, k axis 1: {k.shape[1]}) must be "
                         f"multiples of the world size {n}; ring_attention has no such limit")
    ring = _Ring(group, q.shape[-2], q.device, zigzag, bool(is_causal))
    lengths = [ring.length(r) for r in range(n)]
    # order[row]: the sequence position of each row in rank order (every rank's chunks in turn); its argsort takes
    # rank order to sequence order, order itself takes it back.
    order = [pos for r in range(n) for c, _, _ in ring.chunks(r) for pos in range(*ring.bounds[c])]
    to_seq = torch.tensor(np.argsort(order), device=q.device)
    to_ranks = torch.tensor(order, device=q.device)
    qh, kh, vh = (_seq_to_heads(x, lengths, group).index_select(2, to_seq) for x in (q, k, v))
    out, lse = scaled_dot_product_attention(qh, kh, vh, is_causal=bool(is_causal), scale=scale,
                                            enable_gqa=enable_gqa, window_size=window_size, softcap=softcap,
                                            dropout_p=dropout_p, generator=generator, return_lse=True)
    out = _heads_to_seq(out.index_select(2, to_ranks), lengths, group)
    if not return_lse:
        return out
    lse = _heads_to_seq(lse.detach().unsqueeze(-1).index_select(2, to_ranks), lengths, group)[..., 0]
    return out, lse


def choose_schedule(num_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, world_size: int, *,
                    window: bool = False, softcap: bool = False) -> tuple[str, str]:
    """("ring" or "ulysses", why): the schedule that moves fewer elements per rank in the forward, per row of a shard
    (the backward's transfers scale alike but for the ring's fp32 dK and dV, which favour Ulysses a little more):

        ring:    (N − 1) · Hkv · (E + Ev)          K and V pass every other rank (overlapped with compute)
        ulysses: (N − 1) / N · (Hq · (E + Ev) + Hkv · (E + Ev))   q, k, v out and out back, once each

    Ulysses needs Hq and Hkv to be multiples of N; windows prefer it where the heads divide (the dense kernels skip
    the blocks outside a window), softcap runs on both. Ties go to the ring, whose transfers hide behind compute.

    >>> choose_schedule(32, 8, 128, 128, 2)[0], choose_schedule(32, 32, 128, 128, 8)[0]
    ('ring', 'ulysses')
    >>> choose_schedule(32, 8, 128, 128, 3)[1]
    'ring: the heads (32 query, 8 key/value) are not multiples of the 3 ranks (Ulysses splits them)'
    """
    n = world_size
    if num_heads % n or num_kv_heads % n:
        return "ring", (f"ring: the heads ({num_heads} query, {num_kv_heads} key/value) are not multiples of the "
                        f"{n} ranks (Ulysses splits them)")
    ring = (n - 1) * num_kv_heads * (head_dim + head_dim_v)
    ulysses = (n - 1) / n * (num_heads + num_kv_heads) * (head_dim + head_dim_v)
    if window:
        return "ulysses", ("ulysses: window_size is served by the dense call it runs on whole sequences (its kernels "
                           "skip the blocks outside the window; the ring computes a mask_mod on the pairs it keeps)")
    if ulysses < ring:
        return "ulysses", f"ulysses: {ulysses:.0f} elements moved per shard row against the ring's {ring}"
    return "ring", f"ring: {ring} elements moved per shard row (overlapped) against Ulysses' {ulysses:.0f}"


def context_parallel_attention(q, k, v, *, group=None, is_causal=False, scale=None, enable_gqa=False,
                               return_lse=False, zigzag=True, window_size=None, softcap=None, dropout_p=0.0,
                               generator=None, schedule="auto"):
    """:func:`ring_attention` or :func:`ulysses_attention` (same shards, same result), ``schedule`` "ring",
    "ulysses" or "auto" (:func:`choose_schedule`; dropout takes the ring under "auto", unless a window or softcap
    comes with it: then Ulysses, whose dense call has both). ValueError for another schedule name; a window or
    softcap with dropout on the ring: ring_attention's ValueError."""
    if schedule not in ("auto", "ring", "ulysses"):
        raise ValueError(f"schedule must be 'auto', 'ring' or 'ulysses', got {schedule!r}")
    if schedule == "auto":
        rule = choose_schedule(q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], _group_info(group)[1],
                               window=window_size is not None, softcap=softcap is not None)[0]
        heads_divide = q.shape[1] % _group_info(group)[1] == 0 and k.shape[1] % _group_info(group)[1] == 0
        if dropout_p:  # the ring, but for a window or softcap beside it, which only Ulysses' dense call has with it
            rule = "ulysses" if heads_divide and (window_size is not None or softcap is not None) else "ring"
        schedule = rule
    if schedule == "ulysses":
        return ulysses_attention(q, k, v, group=group, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                 return_lse=return_lse, zigzag=zigzag, window_size=window_size, softcap=softcap,
                                 dropout_p=dropout_p, generator=generator)
    return ring_attention(q, k, v, group=group, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                          return_lse=return_lse, zigzag=zigzag, dropout_p=dropout_p, generator=generator,
                          softcap=softcap, window_size=window_size)

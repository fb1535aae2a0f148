"""The differentiable float64 attention the GPU gradient tests compare against (torch ops), shared by the backward
and dropout tests."""


def torch_attention(q, k, v, mask, causal, scale, groups, keep=None, p=0.0):
    """Attention with cupy_attn's conventions (rows with no visible key give 0); groups > 1: GQA, key/value heads
    repeated; keep (a 0/1 tensor broadcastable to the scores) with dropout probability p: the kept probabilities
    scaled by 1/(1 − p) (cupy_attn.philox.dropout_scale), the row sum taken before dropout."""
    import torch
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        off = 0 if causal in (True, "top_left") else S - L
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(off), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    P = torch.exp(s - m)
    l = P.sum(-1, keepdim=True)
    if keep is not None:
        from cupy_attn import philox
        P = P * keep * philox.dropout_scale(p)
    return (P @ v) / torch.where(l == 0, torch.ones_like(l), l)

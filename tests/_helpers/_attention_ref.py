"""The differentiable attention the GPU tests compare against (torch ops): torch_attention, the float64 reference of the
backward and dropout tests; torch_variant_attention, the variants at the inputs' precision (the error rule's peer) or
in float64 (the gradients' reference), shared by the variants and varlen tests."""


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


def torch_variant_attention(q, k, v, *, scale=None, causal=False, window=None, softcap=None, sinks=None, slopes=None,
                            mask=None):
    """The variants in differentiable torch ops at the inputs' precision (the peer computation of the error rule;
    float64 inputs: the gradients' reference), the sink as a softmax column. scale: default 1/sqrt(E)."""
    import torch
    from cupy_attn import reference
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if Hq != Hkv:
        k, v = k.repeat_interleave(Hq // Hkv, dim=-3), v.repeat_interleave(Hq // Hkv, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        bias = torch.from_numpy(reference.alibi_bias(slopes.double().cpu().numpy(), L, S)).to(q.device, s.dtype)
        s = s + bias
    keep = torch.from_numpy(reference.visible_keys(L, S, causal, window)).to(q.device)
    if mask is not None:
        keep = keep & mask
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        col = sinks.to(s.dtype).reshape(Hq, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, col], dim=-1)
    p = torch.softmax(s.float() if s.dtype != torch.float64 else s, dim=-1).nan_to_num(0.0).to(q.dtype)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v

"""CUDA-graph capture of one scaled_dot_product_attention call, as torch's docs prescribe: two warm-up calls on a side
stream (compiles, plans, call-cache entries and workspaces made outside the capture), then the capture."""
import cupy_attn


def capture_sdpa(q, k, v, **kw):
    """(graph, out): a torch.cuda.CUDAGraph holding one call on the static inputs q, k, v (torch CUDA tensors), and
    the output tensor its replays write."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            cupy_attn.scaled_dot_product_attention(q, k, v, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cupy_attn.scaled_dot_product_attention(q, k, v, **kw)
    return graph, out

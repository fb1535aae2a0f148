"""Schedules that combine kernels, the plan's choices given (cupy_attn/attention/dispatch.py): the split forward
(split.py: GEMMs, the softmax pass or the Hopper scores kernel, P·V; chunks, row bands, streams) and the backward
(backward.py: the fused kernels' launch, or the split backward's GEMMs and row kernels)."""

"""The attention kernels' launchers, one module per kernel family, named as its source: ``kernels/<stem>.py`` ↔
``cuda_src/attention/<stem>.cu`` ↔ ``tests/test_<stem>.py`` ↔ ``bench/bench_<stem>.py``.

Each module holds the family's tile table (``TILES``, each entry with the limit behind it), its KernelFamily
declarations, ``reason(problem, ...)`` (whether it can serve a call, and if not why) and ``build(problem, choice, ...)``
(the PreparedLaunch of a choice the plan made: cupy_attn/attention/dispatch.py), and the small documented functions of
the choices only that kernel makes (its tile, variant or split count), which the plan calls once.

    flash_fwd            FlashAttention-2 forward, mma.sync / wgmma / dropout (sm_80+)
    flash_fwd_sm90       FlashAttention-3-design forward (Hopper: TMA, warp-specialized, persistent)
    flash_fwd_d512_sm90  the forward for head dims 257-512 (Hopper)
    flash_decode         split-KV decode and its combine kernel
    scores_sm90          the split path's Q·Kᵀ with the softmax in the epilogue (Hopper)
    pv_sm90              the split path's P·V after it (Hopper)
    softmax              the split path's mask + softmax pass over fp32 scores
    gemm_3xtf32          fp32 GEMMs on TF32 tensor cores at fp32 accuracy
    flash_bwd            fused backward, mma.sync (sm_80+)
    flash_bwd_sm90       fused backward, FlashAttention-3 design (Hopper)
    bwd_rows             the backward's row kernels (D, P, dS, group sums)
"""

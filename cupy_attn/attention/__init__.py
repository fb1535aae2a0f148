"""Attention: sdpa (public entry points), varlen (varlen_attention: packed batches), merge (merge_attention_states),
mods (AttentionMod: score_mod / mask_mod snippets), checks (argument checks, the problem),
dispatch (the plan: every choice), autograd, dropout; kernels/ (one launcher per kernel family), paths/ (the split and
backward schedules)."""
from .kvcache import attention_with_kvcache
from .merge import merge_attention_states
from .mods import AttentionMod, BlockMask, create_block_mask
from .sdpa import explain, scaled_dot_product_attention
from .varlen import explain as explain_varlen
from .varlen import varlen_attention

__all__ = ["scaled_dot_product_attention", "varlen_attention", "explain", "explain_varlen", "merge_attention_states",
           "AttentionMod", "BlockMask", "create_block_mask", "attention_with_kvcache"]

"""The DFlash drafter (docs/DESIGN.md, "The drafter").

- `model`: `DFlashDrafter` (context features from the target's layers, KV injection in every layer,
  bidirectional blocks), `DrafterConfig`, `build_drafter`, `DrafterCache` for inference.
- `attention`: the training mask (each block sees context strictly before its anchor, plus itself; a
  sliding-window layer only its window, causal in the block: `LayerAttention`) and the attention kernels behind
  one interface (`attention_kernel`, `ATTN_KERNELS`: sdpa, sdpa_expanded, flex).
"""

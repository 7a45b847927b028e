"""Per-example (DP-SGD) clipping.

- `_clips`: `per_example_clip` and `per_example_layer_clip`, on per-example gradients given.
- `ghost/`: `clipped_grad`, which clips each example's gradient without forming it (ghost
  clipping), and `ghost_report`.
"""

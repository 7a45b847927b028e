"""Norms and their numerics: the layer every clip reads.

- `_reductions`: a norm from elementwise terms, accumulated in float32 or wider, with its
  batching and derivative rules (NaN kept, no overflow of the squares).
- `_places`: where concrete arrays live outside `jit`.
- `_axes`: the mesh axes that split each leaf, checked against JAX's.
- `_layers`: key paths; the leaves that stack the layers of a scanned model.
- `_groups`: the group each leaf is in (`GroupNorms`).
- `_norms`: the norm of leaves and trees, over stacks, buckets and devices.
- `_scale`: the clip factor ``min(1, c / norm)`` every clip shares, and its derivative.
"""

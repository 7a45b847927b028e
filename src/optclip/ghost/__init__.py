"""Per-example clipping without per-example gradients (ghost clipping).

`clipped_grad` (`_api`) is a drop-in for ``jax_privacy.clipped_grad``. The engine traces the
per-example loss (`_trace`, with the parameters' views, `_views`), evaluates it with taps at
every use of a parameter (`_interpret`), and computes each parameter's per-example gradient
norm in closed form where the use allows (`_factors`, `_pairs`, `_leaves`), materialising
that leaf's per-example gradient elsewhere; `_sums` computes the clipped sum by book-keeping;
`_passes` puts the passes together; `_eager` runs an eager call as one compiled program;
`_report` says what went where.
"""

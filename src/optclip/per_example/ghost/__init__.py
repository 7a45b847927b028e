"""Per-example clipping without per-example gradients (ghost clipping).

`clipped_grad` (`_api`) is a drop-in for ``jax_privacy.clipped_grad``. The engine, in the order
a step runs it:

1. `_trace` walks the per-example loss's jaxpr once: the parameters' views (`_views`) and the
   *sites* that use them (`_sites`), each classified by its primitive's rule (`_rules`, one
   table: classification, factors, written sums).
2. `_plans` decides each leaf's route: ghost (closed-form norms from its sites' inputs and
   output gradients) or materialised (its per-example gradient formed, that leaf only).
3. `_interpret` evaluates the loss with taps at the ghost sites: one forward and one backward
   pass give every site's records and output gradients (`_passes.tapped_pass`). The taps sit
   on variables (`_shared`): one tap serves every site whose output gradient it gives
   (products added, split into gates or transposed before they meet). Where a scan would
   stack one value twice (a site's record that its backward pass also keeps), `_repeats`
   keeps one stack.
4. `_norms` computes each example's norm from them (`_factors`: the Grams), `_sums` the clipped
   sum by book-keeping (`_products`: the written products); `_passes.finish` puts them
   together for the platform the step is lowered for (`_target`: decided once per step).
   Every record and output gradient is kept divided by a power of two near its largest
   magnitude (`_interpret.scaled`), so that one path is exact at every magnitude: the
   step has no `cond`.

`_eager` runs an eager call as one compiled program; `_report` says what went where.
"""

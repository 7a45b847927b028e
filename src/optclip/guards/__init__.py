"""The guards of a large run, around any optimizer, from one read of the gradients.

- `_accumulate`: gradient accumulation over ``accumulation_steps`` micro-batches.
- `_loss_scale`: dynamic loss scaling (`DynamicLossScale`, `loss_scale`).
- `_spikes`: skipped steps on a spike of the norm or the loss (`SpikeSkip`).
- `_guarded`: `guarded`, which runs the clip, the scale, the skips and the optimizer as one step.
"""

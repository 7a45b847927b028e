"""The clips of TensorFlow and Keras, as functions and as Optax transformations.

- `_functional`: ``tf.clip_by_*`` and ``global_norm`` on pytrees.
- `_steps`: the helpers every transformation's state shares.
- `_nonfinite`: the policies for a non-finite norm (``"propagate"``, ``"zero"``, ``"raise"``).
- `_transforms`: the functions as Optax transformations (`global_clip`, `norm_clip`, ...).
- `_clipped`: Keras' optimizer arguments (`clipped`).
"""

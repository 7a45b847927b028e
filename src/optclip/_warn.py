"""The warning for a concrete threshold <= 0 given to a transformation: it zeroes every update
(TensorFlow's rule), which is almost always a mistake (Keras' rule, that <= 0 turns the clip off,
is `clipped`'s)."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np

from optclip._checks import concrete, is_schedule

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

NONPOSITIVE_REASON = "a threshold <= 0 clips every gradient to zero (TensorFlow's rule)."
NO_CLIP = "If you meant no clipping, leave the clip out."
NO_CLIP_CLIPNORM = (
    "If you meant no clipping (Keras' rule for `clipnorm <= 0`), leave the clip out, or use "
    "`optclip.clipped(optimizer, clipnorm=...)`, which follows Keras."
)
NO_CLIP_GLOBAL_CLIPNORM = (
    "If you meant no clipping (Keras' rule for `global_clipnorm <= 0`), leave the clip out, or "
    "use `optclip.clipped(optimizer, global_clipnorm=...)`, which follows Keras."
)


def warn_if_nonpositive(value, call: str, instead: str, reason: str = NONPOSITIVE_REASON) -> None:
    """Warns that a concrete threshold <= 0 given to a transformation zeroes every update.

    `call` shows the argument (``"global_clip(max_norm=0.0)"``), `reason` why it zeroes the
    update, `instead` what the user may have meant. Traced values and schedules are not looked
    at (`clipped` never calls this: it follows Keras, where <= 0 turns clipping off).
    """
    if is_schedule(value):
        return
    known = concrete(value)
    if known is None or known.shape != () or not np.issubdtype(known.dtype, np.number):
        return
    if not known <= 0:  # (NaN is an error elsewhere)
        return
    frame, level = sys._getframe(), 1
    while frame.f_back is not None and frame.f_back.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"`{call}` zeroes every update: {reason} {instead}",
        UserWarning,
        stacklevel=level + 1,
    )

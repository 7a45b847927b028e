"""optclip: gradient clipping for JAX and Optax.

Every clipping mode of TensorFlow and Keras as pure pytree functions and Optax transformations,
with exact float32 accumulation, the norm kept in the optimizer state, and multi-device
reductions.

The package is a stack of layers; each module imports only from the layers below it:

- `_errors`, `_checks`, `_warn`: errors raised from compiled steps, argument checks, warnings.
- `norms/`: norms of leaves and trees, exact in float32, over stacks, groups and devices.
- `clips/`: TensorFlow's clipping functions and the Optax transformations built on them.
- `guards/`: `guarded`: accumulation, dynamic loss scaling and spike skipping around a clip.
- `adaptive/`: clips with adaptive thresholds (AdaGC, AGC, AutoClip, ZClip).
- `per_example/`: per-example clipping; `per_example/ghost/` is `clipped_grad`'s jaxpr engine.
- `_metrics`: every clip's state as one flat dict.
- this module: the public names, the only ones users import.
"""

import sys as _sys

from optclip._errors import reraise_errors as reraise_errors
from optclip._metrics import metrics as metrics
from optclip.adaptive._adagc import AdaGCState as AdaGCState
from optclip.adaptive._adagc import adagc as adagc
from optclip.adaptive._agc import AGCState as AGCState
from optclip.adaptive._agc import agc as agc
from optclip.adaptive._autoclip import AutoClipState as AutoClipState
from optclip.adaptive._autoclip import autoclip as autoclip
from optclip.adaptive._zclip import ZClipState as ZClipState
from optclip.adaptive._zclip import zclip as zclip
from optclip.clips._clipped import ClippedState as ClippedState
from optclip.clips._clipped import clipped as clipped
from optclip.clips._functional import clip_by_average_norm as clip_by_average_norm
from optclip.clips._functional import clip_by_block_rms as clip_by_block_rms
from optclip.clips._functional import clip_by_global_norm as clip_by_global_norm
from optclip.clips._functional import clip_by_norm as clip_by_norm
from optclip.clips._functional import clip_by_value as clip_by_value
from optclip.clips._functional import global_norm as global_norm
from optclip.clips._nonfinite import NonFiniteNormError as NonFiniteNormError
from optclip.clips._transforms import GlobalClipState as GlobalClipState
from optclip.clips._transforms import ScheduleState as ScheduleState
from optclip.clips._transforms import average_norm_clip as average_norm_clip
from optclip.clips._transforms import block_rms_clip as block_rms_clip
from optclip.clips._transforms import global_clip as global_clip
from optclip.clips._transforms import norm_clip as norm_clip
from optclip.clips._transforms import value_clip as value_clip
from optclip.guards._accumulate import AccumulationState as AccumulationState
from optclip.guards._guarded import GuardedState as GuardedState
from optclip.guards._guarded import guarded as guarded
from optclip.guards._loss_scale import DynamicLossScale as DynamicLossScale
from optclip.guards._loss_scale import LossScaleState as LossScaleState
from optclip.guards._loss_scale import loss_scale as loss_scale
from optclip.guards._spikes import SpikeSkip as SpikeSkip
from optclip.guards._spikes import SpikeState as SpikeState
from optclip.norms._axes import AxisNameError as AxisNameError
from optclip.norms._axes import check_split as check_split
from optclip.norms._groups import GroupNorms as GroupNorms
from optclip.per_example._clips import per_example_clip as per_example_clip
from optclip.per_example._clips import per_example_layer_clip as per_example_layer_clip
from optclip.per_example.ghost._api import AuxiliaryOutput as AuxiliaryOutput
from optclip.per_example.ghost._api import ClippedGradFn as ClippedGradFn
from optclip.per_example.ghost._api import clipped_grad as clipped_grad
from optclip.per_example.ghost._plans import force_ghost_route as force_ghost_route
from optclip.per_example.ghost._report import GhostReport as GhostReport
from optclip.per_example.ghost._report import LeafReport as LeafReport
from optclip.per_example.ghost._report import ghost_report as ghost_report

__version__ = "0.1.0"

# Where the modules that define the public states were before they moved into subpackages: a
# state pickled by an earlier version names its class by its old module, so each old name is an
# alias of the module in its new place.
_MOVED = {
    "_accumulate": "guards",
    "_adagc": "adaptive",
    "_agc": "adaptive",
    "_autoclip": "adaptive",
    "_clipped": "clips",
    "_groups": "norms",
    "_guarded": "guards",
    "_loss_scale": "guards",
    "_spikes": "guards",
    "_transforms": "clips",
    "_zclip": "adaptive",
}
for _name, _package in _MOVED.items():
    _sys.modules.setdefault(f"optclip.{_name}", _sys.modules[f"optclip.{_package}.{_name}"])
del _name, _package

__all__ = [
    "AGCState",
    "AccumulationState",
    "AdaGCState",
    "AutoClipState",
    "AuxiliaryOutput",
    "AxisNameError",
    "ClippedGradFn",
    "ClippedState",
    "DynamicLossScale",
    "GhostReport",
    "GlobalClipState",
    "GroupNorms",
    "GuardedState",
    "LeafReport",
    "LossScaleState",
    "NonFiniteNormError",
    "ScheduleState",
    "SpikeSkip",
    "SpikeState",
    "ZClipState",
    "adagc",
    "agc",
    "autoclip",
    "average_norm_clip",
    "check_split",
    "block_rms_clip",
    "clip_by_average_norm",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clipped_grad",
    "clipped",
    "force_ghost_route",
    "ghost_report",
    "global_clip",
    "global_norm",
    "guarded",
    "loss_scale",
    "metrics",
    "norm_clip",
    "per_example_clip",
    "per_example_layer_clip",
    "reraise_errors",
    "value_clip",
    "zclip",
]

"""optclip: gradient clipping for JAX and Optax.

Every clipping mode of TensorFlow and Keras as pure pytree functions and Optax transformations,
with exact float32 accumulation, the norm kept in the optimizer state, and multi-device
reductions.
"""

from optclip._accumulate import AccumulationState as AccumulationState
from optclip._adagc import AdaGCState as AdaGCState
from optclip._adagc import adagc as adagc
from optclip._agc import AGCState as AGCState
from optclip._agc import agc as agc
from optclip._autoclip import AutoClipState as AutoClipState
from optclip._autoclip import autoclip as autoclip
from optclip._axes import AxisNameError as AxisNameError
from optclip._axes import check_split as check_split
from optclip._clipped import ClippedState as ClippedState
from optclip._clipped import clipped as clipped
from optclip._errors import reraise_errors as reraise_errors
from optclip._functional import clip_by_average_norm as clip_by_average_norm
from optclip._functional import clip_by_block_rms as clip_by_block_rms
from optclip._functional import clip_by_global_norm as clip_by_global_norm
from optclip._functional import clip_by_norm as clip_by_norm
from optclip._functional import clip_by_value as clip_by_value
from optclip._functional import global_norm as global_norm
from optclip._groups import GroupNorms as GroupNorms
from optclip._guarded import GuardedState as GuardedState
from optclip._guarded import guarded as guarded
from optclip._loss_scale import DynamicLossScale as DynamicLossScale
from optclip._loss_scale import LossScaleState as LossScaleState
from optclip._loss_scale import loss_scale as loss_scale
from optclip._metrics import metrics as metrics
from optclip._nonfinite import NonFiniteNormError as NonFiniteNormError
from optclip._per_example import per_example_clip as per_example_clip
from optclip._per_example import per_example_layer_clip as per_example_layer_clip
from optclip._spikes import SpikeSkip as SpikeSkip
from optclip._spikes import SpikeState as SpikeState
from optclip._transforms import GlobalClipState as GlobalClipState
from optclip._transforms import ScheduleState as ScheduleState
from optclip._transforms import average_norm_clip as average_norm_clip
from optclip._transforms import block_rms_clip as block_rms_clip
from optclip._transforms import global_clip as global_clip
from optclip._transforms import norm_clip as norm_clip
from optclip._transforms import value_clip as value_clip
from optclip._zclip import ZClipState as ZClipState
from optclip._zclip import zclip as zclip
from optclip.ghost._api import AuxiliaryOutput as AuxiliaryOutput
from optclip.ghost._api import ClippedGradFn as ClippedGradFn
from optclip.ghost._api import clipped_grad as clipped_grad
from optclip.ghost._plans import force_ghost_route as force_ghost_route
from optclip.ghost._report import GhostReport as GhostReport
from optclip.ghost._report import LeafReport as LeafReport
from optclip.ghost._report import ghost_report as ghost_report

__version__ = "0.1.0"

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

"""Errors raised from inside a compiled step, and `reraise_errors` to get them back as
themselves.

A check that can only decide when the step runs (a non-finite norm with ``nonfinite="raise"``,
a leaf declared split that is the same on every device) raises from a host callback. JAX stops
the computation, logs the callback's traceback to stderr, and raises its own
``JaxRuntimeError``, whose message holds the original error's text among a traceback: an
``except optclip.NonFiniteNormError`` around a jitted step does not catch it.
`raise_from_callback` records each error before raising it, and `reraise_errors` turns JAX's
error back into the recorded one (and keeps the callback's traceback off stderr).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading

import jax

_RECORDED: collections.deque = collections.deque(maxlen=16)  # the last errors raised
_LOCK = threading.Lock()
_ACTIVE = [0]  # how many `reraise_errors` blocks are open (any thread)
# JAX logs the traceback of a failing `jax.debug.callback` here (jax/_src/debugging.py).
_CALLBACK_LOGGER = logging.getLogger("jax._src.debugging")


def raise_from_callback(error: BaseException) -> None:
    """Raises `error` from a host callback, recorded for `reraise_errors`."""
    error._optclip_from_callback = True  # type: ignore[attr-defined]
    with _LOCK:
        _RECORDED.append(error)
    raise error


def _hide_recorded(record: logging.LogRecord) -> bool:
    """A logging filter: drops JAX's report of an error that `reraise_errors` re-raises."""
    error = record.exc_info[1] if record.exc_info else None
    return not getattr(error, "_optclip_from_callback", False)


def _recorded_in(runtime_error: BaseException) -> BaseException | None:
    """The recorded error that `runtime_error` (JAX's) reports, if any: matched by its message,
    or else by its class name, newest first."""
    text = str(runtime_error)
    with _LOCK:
        candidates = list(reversed(_RECORDED))
        match = next((e for e in candidates if str(e) and str(e) in text), None)
        if match is None:
            match = next((e for e in candidates if f"{type(e).__name__}:" in text), None)
        if match is not None:
            _RECORDED.clear()
    return match


def _drop_failed_tokens() -> None:
    """Forgets the failed step's runtime tokens. After a callback raised on several devices
    (under `pmap`), JAX keeps each device's failed token and raises its error once more when
    the process exits ("Exception ignored in atexit callback"). Only tokens that hold an error
    are dropped; JAX has no public way to do it, so a JAX without this private table is left
    as it is."""
    try:
        from jax._src import dispatch

        tokens = dispatch.runtime_tokens.output_runtime_tokens
        for device, token in list(tokens.items()):
            try:
                token.block_until_ready()
            except Exception:  # noqa: BLE001 - a token holding an error: the failed step's
                del tokens[device]
    except Exception:  # noqa: BLE001 - another JAX: nothing to drop
        pass


@contextlib.contextmanager
def reraise_errors():
    """Inside this block, optclip's errors raised by a compiled step reach you as themselves.

    Under ``jit`` (``pmap``, ``shard_map``), :class:`NonFiniteNormError` (``nonfinite="raise"``)
    and the :class:`AxisNameError` of :func:`check_split` are raised when the step runs, from a
    host callback, and JAX reports them as its own ``jax.errors.JaxRuntimeError`` (with the
    original message inside a traceback, and the traceback printed on stderr). Inside this
    block such a runtime error is replaced by the original optclip error, and JAX's stderr
    report of it is left out. Anything else passes through unchanged. Also a decorator
    (``@optclip.reraise_errors()``).

    JAX reports the error where the step's results are first waited for: on CPU, the call
    itself; on an accelerator, maybe later (``jax.block_until_ready``, reading a value, the next
    step). Put the code that uses the results inside the block too: a training loop fits.

    Returns:
      A context manager (and decorator).

    Raises:
      NonFiniteNormError: a clip with ``nonfinite="raise"`` met a non-finite norm in a step run
        inside the block.
      AxisNameError: :func:`check_split` found a leaf declared split that is the same on every
        device.

    Examples:
      >>> import jax, jax.numpy as jnp, optclip
      >>> clip = optclip.global_clip(1.0, nonfinite="raise")
      >>> step = jax.jit(clip.update)
      >>> grads = {"w": jnp.array([1.0, jnp.nan])}
      >>> try:
      ...     with optclip.reraise_errors():
      ...         updates, state = step(grads, clip.init(grads))
      ...         _ = jax.block_until_ready(updates)  # (where a GPU reports it)
      ... except optclip.NonFiniteNormError as error:
      ...     print("caught:", type(error).__name__)
      caught: NonFiniteNormError
    """
    with _LOCK:
        if _ACTIVE[0] == 0:
            _CALLBACK_LOGGER.addFilter(_hide_recorded)
        _ACTIVE[0] += 1
    try:
        yield
    except jax.errors.JaxRuntimeError as runtime_error:
        error = _recorded_in(runtime_error)
        if error is None:
            raise
        _drop_failed_tokens()
        raise error from None
    finally:
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                _CALLBACK_LOGGER.removeFilter(_hide_recorded)

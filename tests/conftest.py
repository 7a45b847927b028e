"""Shared test fixtures."""

import jax
import pytest


@pytest.fixture(params=["eager", "jit"])
def mode(request):
    """Runs a test once eagerly and once under `jax.jit`."""
    return request.param


@pytest.fixture
def strict_promotion():
    """optclip's own code under strict dtype promotion: a silent upcast is an error.

    (Optax's optimizers are not written for strict promotion, so tests that run them don't
    use this.)
    """
    with jax.numpy_dtype_promotion("strict"):
        yield

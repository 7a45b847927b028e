"""XLA's CPU backend emits fusions the older way while JAX compiles with few optimizations.

XLA's CPU backend has two ways to turn a fusion into machine code: its fusion emitters (the
default) and the older elemental emitters (``xla_cpu_use_fusion_emitters=false``). The older way
compiles a test's small programs in about half the time. It also leaves a lone reduction
unwrapped instead of giving it a fusion of its own, so the optimized HLO is not quite users':
a test that reads a compiled program's text or memory compiles as users do
(`conftest.as_users_compile`).

`follow_few_optimizations` makes every compile of this process for a CPU ask for the older
emitters whenever ``jax_disable_most_optimizations`` is on, and only then, so that the fixtures
that turn JAX's optimizations back on (`as_users_compile`) give users' programs. The test
processes and the 8-device workers call it. JAX has no public setting for a compile option of
every program, so it wraps `jax._src.compiler.get_compile_options`. Where a JAX version lacks
it, the tests run without the option, and the setting's own test fails and says so.
"""

from __future__ import annotations

import functools

import jax

OPTION = ("xla_cpu_use_fusion_emitters", False)


def follow_few_optimizations() -> bool:
    """Installs the wrapper (once per process); returns whether it is installed."""
    try:
        from jax._src import compiler
    except ImportError:
        return False
    original = getattr(compiler, "get_compile_options", None)
    if original is None:
        return False
    if getattr(original, "follows_few_optimizations", False):
        return True

    @functools.wraps(original)
    def get_compile_options(*args, backend=None, **kwargs):
        options = original(*args, backend=backend, **kwargs)
        platform = jax.default_backend() if backend is None else backend.platform
        if jax.config.values["jax_disable_most_optimizations"] and platform == "cpu":
            overrides = dict(options.env_option_overrides)
            overrides.setdefault(*OPTION)
            options.env_option_overrides = list(overrides.items())
        return options

    get_compile_options.follows_few_optimizations = True  # type: ignore[attr-defined]
    compiler.get_compile_options = get_compile_options
    return True

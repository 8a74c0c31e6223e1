"""jax's transfer guard for every thread: the engine's pool runs on a thread of its own, and
`jax.transfer_guard(...)` as a context manager guards the calling thread only."""

import contextlib

import jax


@contextlib.contextmanager
def no_implicit_transfers():
    """Any implicit host-device transfer, on any thread, raises inside the block."""
    old = jax.config.jax_transfer_guard
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard", old)

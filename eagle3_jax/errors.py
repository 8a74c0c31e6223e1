"""Errors the library raises for bad input."""


class CheckpointError(ValueError):
    """A checkpoint folder, file, tensor or config that cannot be used.

    The message always names the file and, where there is one, the key.
    """

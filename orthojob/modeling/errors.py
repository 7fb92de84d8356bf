"""The modeling errors."""


class ModelError(RuntimeError):
    """A checkpoint or model that cannot be loaded or digested; the message says what is wrong."""

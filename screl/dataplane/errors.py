"""The data plane's errors (importable without Ray or TransferQueue)."""

from __future__ import annotations


class DataPlaneError(RuntimeError):
    """The data plane is missing, misused, or a request could not be served."""


class DataPlaneTimeoutError(DataPlaneError, TimeoutError):
    """A data-plane call did not finish within its timeout."""


class DataPlaneKeyError(DataPlaneError):
    """Requested keys or fields are not (or not yet) in the data plane."""

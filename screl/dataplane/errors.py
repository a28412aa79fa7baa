"""The data plane's errors (importable without Ray or TransferQueue)."""

from __future__ import annotations


class DataPlaneError(RuntimeError):
    """The data plane is missing, misused, or a request could not be served."""


class DataPlaneTimeoutError(DataPlaneError, TimeoutError):
    """A data-plane call did not finish within its timeout."""


class DataPlaneKeyError(DataPlaneError):
    """Requested keys or fields are not (or not yet) in the data plane."""


class DataPlaneLostError(DataPlaneError):
    """A TransferQueue actor (its controller or a storage unit) died: the rows it held are gone until a resume from
    the last checkpoint bundle."""

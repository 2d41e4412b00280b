"""The exceptions of elastic_np, in a module of their own that imports nothing.

The backends raise them without importing the dispatcher (`elastic_np._dispatch`),
which re-exports them, as does `elastic_np` itself.
"""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (missing package or device).

    Examples
    --------
    >>> import elastic_np as enp
    >>> issubclass(enp.BackendUnavailableError, RuntimeError)
    True
    """

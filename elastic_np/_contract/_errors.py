"""The exceptions and warnings of elastic_np, in a module of their own that imports nothing.

The backends raise them without importing the dispatcher (`elastic_np._api.dispatch`),
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


class CompileWarning(UserWarning):
    """A kernel is compiling on its first call in this process: seconds, once (later processes load it).

    Issued once per process, as the first compile outside `elastic_np.warmup`
    starts, at the line of the call that compiles (the first caller outside
    elastic_np); Python shows it on stderr.
    Silence it with
    ``warnings.filterwarnings("ignore", category=elastic_np.CompileWarning)``,
    or compile ahead of the calls with `elastic_np.warmup` (``elastic-np
    warmup``). Every compile is also logged at INFO level on the
    ``"elastic_np"`` logger, with what compiled and how long it took.

    Examples
    --------
    >>> import elastic_np as enp
    >>> issubclass(enp.CompileWarning, UserWarning)
    True
    """

"""The folder the ``kernels`` package loads `CONTINUOUS_BATCHING` from: one build, ``torch-universal``.

A kernel's folder holds a build per platform (``torch-universal``: Python
code for any); the ``kernels`` package picks the build, checks its files
against the digest in its ``metadata.json``, and imports its ``__init__.py``.
"""

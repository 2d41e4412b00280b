"""The contract every layer shares: the options' table, the problem, the checks, the types, the backend face.

It imports nothing else of the package; every other package may take its
private names (``tests/package/test_layout.py``).
"""

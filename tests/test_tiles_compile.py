"""The tile functions compile one dtype at a time: a float32 call never waits for float64."""

import subprocess
import sys

SCRIPT = """
import numpy as np
from numba import types
from elastic_np import _tiles
assert all(len(d.overloads) == 0 for d, _ in _tiles._TYPED), "compiled at import"
_tiles.compile_for(np.float32)
_tiles.compile_for(np.float32)
for dispatcher, signatures in _tiles._TYPED:
    want = {s.args for s in signatures if s.args[0].dtype == types.float32}
    assert set(dispatcher.overloads) == want, (dispatcher, set(dispatcher.overloads), want)
try:
    _tiles.matmul_nn(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), 2, 2, 2, False)
except TypeError:
    pass
else:
    raise AssertionError("float64 compiled without compile_for(float64)")
_tiles.compile_for(np.float64)
c = np.zeros((2, 2))
_tiles.matmul_nn(np.ones((2, 2)), np.ones((2, 2)), c, 2, 2, 2, False)
assert (c == 2).all()
print("ok")
"""


def test_compile_for_compiles_only_its_dtype():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

"""The tile functions compile one dtype at a time: a float32 call never waits for float64."""

import os
import subprocess
import sys

import pytest

from elastic_np.cpu._runtime import numba_private as _numba_private

SCRIPT = """
import numpy as np
from numba import types
from elastic_np.cpu._tiles import products as _products, simd as _simd
assert all(len(d.overloads) == 0 for d, _, _ in _simd._TYPED), "compiled at import"
_simd.compile_for(np.float32)
_simd.compile_for(np.float32)
for dispatcher, signatures, _ in _simd._TYPED:
    want = {s.args for s in signatures if s.args[0].dtype == types.float32}
    assert set(dispatcher.overloads) == want, (dispatcher, set(dispatcher.overloads), want)
try:
    _products.matmul_nn(np.ones((2, 2)), 0, np.ones((2, 2)), 0, np.ones((2, 2)), 2, 2, 2, False)
except TypeError:
    pass
else:
    raise AssertionError("float64 compiled without compile_for(float64)")
_simd.compile_for(np.float64)
c = np.zeros((2, 2))
_products.matmul_nn(np.ones((2, 2)), 0, np.ones((2, 2)), 0, c, 2, 2, 2, False)
assert (c == 2).all()
print("ok")
"""


def test_compile_for_compiles_only_its_dtype():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(not _numba_private.enabled("inner"), reason="private path inner off: helpers are plain njit")
def test_kernel_helpers_are_only_callable_from_compiled_code():
    # `_numba_private.inner` builds no Python wrapper: a call from Python raises, never runs a null entry.
    from elastic_np.cpu._tiles import logits as _logits, scalar as _scalar

    assert isinstance(_logits._remove_in_tile, _numba_private._Inner)
    with pytest.raises(TypeError, match="`log_add_exp` is only callable from compiled code"):
        _scalar.log_add_exp(0.0, 1.0)


def _processes(script, cache_dir, count=1):
    """``count`` processes running ``script`` one after the other, sharing the Numba cache ``cache_dir``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    return [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env)
        for _ in range(count)
    ]


# The products' public names compile too where the kernels call them, not their shared C entry point.
_ALL_PRODUCTS = "" if _numba_private.enabled("entry_points") else " matmul_nn matmul_nn_max matmul_tn"


#: What a first forward and backward compile of the tile functions (`test_kernels_from_the_cache_call_the_tile_functions`
#: checks it: its first process runs them, after a decode, whose own are a part of these).
FORWARD_BACKWARD = "_exp_f32 _matmul exp_inplace exp_shift_sum" + _ALL_PRODUCTS
#: What a first decode compiles of them (its products are its own, `_decode_products`).
DECODE = "_exp_f32 exp_inplace"
#: The stages that compile on first use, after each step of `FROM_CACHE`'s float32 calls: none without a modifier
#: or a bias.
LAZY_STAGES = ["plain -", "softcap modify_tile", "bias dbias_tile,modify_tile"]

FROM_CACHE = """
import hashlib
import numpy as np
import elastic_np as enp
from elastic_np import reference
from elastic_np.cpu._decode import decode as _decode
from elastic_np.cpu._prefill import backward as _backward, forward as _forward
from elastic_np.cpu._runtime import numba_private as _numba_private
from elastic_np.cpu._tiles import simd as _simd

def tile_functions():
    return " ".join(sorted(d.py_func.__name__ for d, _, _ in _simd._TYPED if d.overloads))

rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, 4, 24, 16)).astype(np.float32) for _ in range(4))
out1 = enp.attention(q[:, :, :1], k, v, causal=True)
after_decode = tile_functions()
out, lse = enp.attention(q, k, v, causal=True, return_lse=True)
grads = enp.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
kernels = (_decode._decode_kernel, _forward._forward_kernel, _backward._backward_kernel)
print(sum(sum(f.stats.cache_hits.values()) for f in kernels), float(out1.sum()), float(out.sum()), float(grads.dq.sum() + grads.dk.sum() + grads.dv.sum()))
print(after_decode)
print(tile_functions())
bias = rng.standard_normal((24, 24)).astype(np.float32)
steps = [("plain", {}), ("softcap", dict(softcap=5.0)), ("bias", dict(bias=bias, alibi_slopes=[0.1, 0.2, 0.3, 0.4]))]
for name, opts in steps:
    out, lse = enp.attention(q, k, v, causal=True, return_lse=True, **opts)
    grads = enp.attention_backward(dout, q, k, v, out, lse, causal=True, **opts)
    q64, k64, v64, dout64 = (a.astype(np.float64) for a in (q, k, v, dout))
    want_out, want_lse = reference.attention(q64, k64, v64, causal=True, **opts)
    want = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, causal=True, **opts)
    assert np.allclose(out, want_out, atol=1e-5) and np.allclose(grads.dq, want.dq, atol=1e-4), name
    if "bias" in opts:
        assert np.allclose(grads.dbias, want.dbias, atol=1e-4)
    print(name, ",".join(sorted(symbol.split("_", 2)[2].rsplit("_", 1)[0] for symbol in _numba_private._LAZY)) or "-")
q64 = rng.standard_normal((2, 4, 1, 8))
k64 = rng.standard_normal((2, 2, 31, 8))
v64 = rng.standard_normal((2, 2, 31, 6))
out64 = enp.attention(q64, k64, v64, softcap=0.9, tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5])
print(hashlib.sha256(out64.tobytes()).hexdigest())
"""


def test_kernels_from_the_cache_call_the_tile_functions(tmp_path):
    """A new process loads the kernels from the cache; their calls of the tile functions resolve there too. The
    first process, which compiles, compiles the tile functions its calls call, and only those: a decode's
    (`DECODE`), then a forward's and a backward's (`FORWARD_BACKWARD`).

    The score modifiers' and the bias gradient's stages compile on first use (`LAZY_STAGES`), and kernels loaded
    from the cache call them too (with the private path ``lazy_stages``; without it they are linked in).

    And a kernel calls its own copy of each helper, not one compiled apart: the process that compiles gets the
    bits of the processes that load (a float64 decode; when the helpers had machine code of their own, the
    compiling process's decode kernel called it and differed in the last bit). Without the private path
    ``inner``, the compiling process may call a helper's own machine code: that check is left out.
    """
    runs = _processes(FROM_CACHE, tmp_path, count=2)
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr
    lines = [run.stdout.split("\n") for run in runs]
    (first_hits, *first), (second_hits, *second) = (line[0].split() for line in lines)
    assert first_hits == "0" and second_hits == "3"
    assert first == second
    assert lines[0][1:3] == [DECODE, FORWARD_BACKWARD]
    if _numba_private.enabled("lazy_stages"):
        assert lines[0][3:6] == lines[1][3:6] == LAZY_STAGES
    if _numba_private.enabled("inner"):
        assert lines[0][6] == lines[1][6]

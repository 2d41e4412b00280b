"""The CPU kernels' score modifiers: bias shapes, layouts and dtypes, the dbias reductions, no copies, value checks."""

import importlib
import pkgutil

import numba
import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from elastic_np._contract import _grads, _problem
from elastic_np.cpu._prefill.dbias import _store_transposed
from elastic_np.cpu._tiles.transpose import stream_width
from oracle_checks import (
    ALIBI_BH,
    ALIBI_H,
    BIASES,
    DTYPES,
    LAYOUTS,
    check_case,
    check_unmodified_and_deterministic,
    laid_out,
    make_inputs,
    random_bias,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["full", "nm", "1h1m-keypad", "bhn1", "scalar"])
def test_bias_other_dtype(small_tiles, dtype, bias_name):
    # a float32 bias with float64 q and a float64 bias with float32 q
    other = np.float32 if dtype == np.float64 else np.float64
    bias = BIASES[bias_name].astype(other)
    _, _, grads = check_case(dtype, dict(bias=bias, softcap=2.0, alibi_slopes=ALIBI_H))
    assert grads.dbias.shape == bias.shape and grads.dbias.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,bias_shape",
    [
        (dict(N=1, M=31), (1, 31)),
        (dict(N=1, M=31), (2, 4, 1, 1)),
        (dict(N=23, M=1), (2, 4, 23, 1)),
        (dict(N=23, M=1), (1,)),
        (dict(N=1, M=1), (2, 1, 1, 1)),
        (dict(N=31, M=12), (4, 31, 12)),
        (dict(B=1, H=3, Hkv=1, N=17, M=9), (3, 1, 9)),
    ],
)
def test_modifiers_degenerate_lengths(small_tiles, dtype, shape, bias_shape):
    H = shape.get("H", 4)
    opts = dict(
        bias=random_bias(bias_shape, 11, pad=0.1), softcap=1.2, alibi_slopes=np.linspace(0.1, 0.4, H),
        causal=True, beta=0.3,
    )
    check_case(dtype, opts, **shape)


@pytest.mark.parametrize(
    "dtype,opts",
    [
        (np.float64, dict(softcap=5.0, alibi_slopes=[0.01, 0.002], causal=True, tau=0.8)),
        (np.float32, dict(softcap=2.0, bias=random_bias((2, 97, 1025), 12, pad=0.05), beta=0.2)),
        (np.float64, dict(bias=random_bias((1, 2, 1, 1025), 13, pad=0.2), nvm=True, kv_lengths=[1000])),
        (np.float32, dict(bias=random_bias((97, 1), 14), window_size=(300, 40))),
        # whole 8 x 8 float64 blocks through registers, and the edges
        (np.float64, dict(bias=random_bias((1, 2, 97, 1025), 15, pad=0.05), causal=True)),
        # an (N, M) bias: dbias summed over the heads through transposed blocks
        (np.float32, dict(bias=random_bias((97, 1025), 16), softcap=3.0)),
        (np.float64, dict(bias=random_bias((97, 1025), 17, pad=0.05), beta=0.5)),
    ],
)
def test_modifiers_default_tiles_odd_sizes(dtype, opts):
    check_case(dtype, opts, B=1, H=2, Hkv=1, N=97, M=1025, D=59, Dv=59)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["nm", "bhn1", "b1n1", "scalar", "1hnm"])
@pytest.mark.parametrize(
    "min_tasks,partial_bytes",
    # lanes of one pair; one lane of all pairs; one lane, for want of memory
    [(10**6, 1 << 25), (1, 1 << 25), (10**6, 1)],
)
def test_dbias_lanes_and_chunks(small_tiles, monkeypatch, dtype, bias_name, min_tasks, partial_bytes):
    # one key tile per chunk of dq shares
    monkeypatch.setattr(cpu._runtime.config, "DQ_SHARES_BYTES", 1)
    monkeypatch.setattr(cpu._runtime.config, "DBIAS_MIN_TASKS", min_tasks)
    monkeypatch.setattr(cpu._runtime.config, "DBIAS_PARTIALS_BYTES", partial_bytes)
    check_case(dtype, dict(bias=BIASES[bias_name], softcap=1.5, causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dbias_summed_over_heads_with_their_own_ranges(small_tiles, monkeypatch, dtype):
    # a task's heads visit different query tiles (a gate per head, lengths
    # per batch) and some tiles none: the sum over heads and pairs
    monkeypatch.setattr(cpu._runtime.config, "DBIAS_MIN_TASKS", 1)
    sigma = np.array([[0.05, 0.5, 0.1, 1.2], [0.6, 0.08, 0.4, 2.0]])
    opts = dict(
        bias=BIASES["nm"], kv_lengths=[9, 31], nvm=True, tau=[0.5, 1.0, 2.0, 0.8],
        dynamic_window=enp.DynamicWindow(sigma, sharpness=3.0, threshold=0.3),
    )
    check_case(dtype, opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["full", "nm"])
def test_dbias_streamed_on_cache_lines(monkeypatch, dtype, layout):
    # 48 keys, whole cache lines in both dtypes: the rows of dbias start on
    # lines and `_store_transposed` streams them (a full bias; the broadcast
    # one goes to float64 partials), the 37 queries leave edges to it
    monkeypatch.setattr(cpu._runtime.config, "DBIAS_MIN_TASKS", 1)
    bias = random_bias((2, 4, 37, 48), 11) if layout == "full" else random_bias((37, 48), 12)
    check_case(dtype, dict(bias=bias, causal=True, kv_lengths=[48, 29]), N=37, M=48)


@numba.njit
def store_transposed(tile, bk, bq, dst, start, stride, scale):
    _store_transposed(tile, bk, bq, dst, start, stride, scale)  # only callable from compiled code


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("on_lines", [True, False])
def test_store_transposed_on_and_off_cache_lines(dtype, on_lines):
    # runs starting on cache lines are streamed, others stored: the same entries
    line = stream_width(dtype)
    bk, bq, stride = 2 * line + 3, 21, 3 * line
    tile = np.random.default_rng(7).standard_normal((bk + 1, bq + 2)).astype(dtype)
    dst = cpu._prefill.dbias._zeros_on_lines(bq * stride + 2 * line, dtype)
    assert dst.ctypes.data % 64 == 0
    dst[:] = np.nan
    start = line if on_lines else line + 1
    store_transposed(tile, bk, bq, dst, start, stride, dtype(0.5))
    view = dst[start : start + bq * stride].reshape(bq, stride)
    np.testing.assert_array_equal(view[:, :bk], dtype(0.5) * tile[:bk, :bq].T)
    assert np.isnan(view[:, bk:]).all() and np.isnan(dst[:start]).all()  # nothing else written
    assert np.isnan(dst[start + bq * stride :]).all()


def test_dbias_plan_lanes():
    # broadcast over (b, h): folded pairs split into lanes by DBIAS_MIN_TASKS and memory
    q, k, v, _ = make_inputs(np.float64)  # B=2, H=4, Hkv=2, N=23, M=31
    p = _problem.prepare(q, k, v, bias=BIASES["nm"], dtypes=cpu.dtypes)
    plan = cpu._prefill.dbias.DbiasPlan(p, np.dtype(np.float64), n_kt=1, chunk=1)
    assert plan.params.tolist() == [2, 1, 1, 4, 1]
    assert plan.shape == (1, 1, 23, 31) and plan.partials.shape == (4, 23 * 31)
    # enough key tiles for the tasks: one lane of the 4 pairs, one float64 partial
    plan = cpu._prefill.dbias.DbiasPlan(p, np.dtype(np.float32), n_kt=64, chunk=8)
    assert plan.params.tolist() == [2, 1, 1, 1, 1] and plan.partials.shape == (1, 23 * 31)
    p = _problem.prepare(q, k, v, bias=BIASES["full"], dtypes=cpu.dtypes)
    plan = cpu._prefill.dbias.DbiasPlan(p, np.dtype(np.float64), n_kt=7, chunk=7)
    assert plan.params[0] == 1 and plan.direct.shape == (2 * 4 * 23 * 31,)
    p = _problem.prepare(q, k, v, bias=BIASES["bhn1"], dtypes=cpu.dtypes)
    plan = cpu._prefill.dbias.DbiasPlan(p, np.dtype(np.float64), n_kt=7, chunk=3)
    assert plan.params.tolist() == [2, 0, 0, 1, 3] and plan.partials.shape == (3, 2 * 4 * 23)


def test_reduce_to_shape_sums_only_axes_longer_than_one():
    # dbias computed in its compact (1, 1, N, M) shape comes back as a view:
    # no pass over it to "sum" axes of length 1
    grad = np.arange(2 * 3 * 4, dtype=np.float32).reshape(1, 1, 6, 4)
    out = _grads.reduce_to_shape(grad, (6, 4))
    assert out.shape == (6, 4) and out.dtype == np.float32 and np.shares_memory(out, grad)
    full = np.arange(2 * 3 * 6 * 4, dtype=np.float64).reshape(2, 3, 6, 4)
    for shape in [(6, 4), (3, 1, 4), (1, 6, 1), (2, 1, 1, 1), ()]:
        lead = full.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1)
        want = full.sum(axis=axes, keepdims=True).reshape(shape)
        np.testing.assert_array_equal(_grads.reduce_to_shape(full, shape), want)


def test_every_jit_function_states_its_fastmath():
    # Numba compiles a function without its own `fastmath` with the flags of
    # whatever compiles it first and keeps that version: the tile code took the
    # forward kernel's flags, or none when a backward (or a call from Python)
    # came first, and the kernels' last bits changed with the order (measured:
    # 488 of 1104 float32 entries of `out`). Inlined functions take their caller's.
    jitted = {}
    for info in pkgutil.walk_packages(cpu.__path__, f"{cpu.__name__}."):
        module = importlib.import_module(info.name)
        jitted.update({
            f"{info.name}.{name}": f for name, f in vars(module).items()
            if isinstance(f, numba.core.registry.CPUDispatcher) and f.py_func.__module__ == module.__name__
        })
    assert len(jitted) > 20
    for name, f in jitted.items():
        assert "fastmath" in f.targetoptions or f.targetoptions.get("inline") == "always", name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bias_not_copied(dtype, layout):
    # The kernels read the caller's memory at its strides; only negative
    # strides (or another dtype, below) make a copy. Never written.
    q, k, v, _ = make_inputs(dtype)
    for name in ("full", "nm", "1h1m-keypad", "bhn1"):
        bias = laid_out(BIASES[name].astype(dtype), layout)
        p = _problem.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
        opt = cpu._prefill.plan.kernel_options(p, with_sigma_grad=True, dtype=np.dtype(dtype))
        assert np.shares_memory(opt.bias, bias) == (layout != "reversed" or bias.shape[-1] == 1)
        assert not opt.bias.flags.writeable
        # the same entries through the strides
        b_, h_, i_, j_ = (np.arange(n)[:, None, None, None] for n in (2, 4, 23, 31))
        idx = (b_ * opt.bias_strides[0] + np.swapaxes(h_, 0, 1) * opt.bias_strides[1]
               + np.moveaxis(i_, 0, 2) * opt.bias_strides[2] + np.moveaxis(j_, 0, 3) * opt.bias_strides[3])
        np.testing.assert_array_equal(opt.bias[idx], np.broadcast_to(bias, (2, 4, 23, 31)))
    # another dtype is converted into a copy, never the caller's array written
    other = BIASES["nm"].astype(np.float32 if dtype == np.float64 else np.float64)
    opt = cpu._prefill.plan.kernel_options(_problem.prepare(q, k, v, bias=other, dtypes=cpu.dtypes), False, np.dtype(dtype))
    assert opt.bias.dtype == dtype and not np.shares_memory(opt.bias, other)
    np.testing.assert_array_equal(opt.bias.reshape(23, 31), other.astype(dtype))


# Options that skip tiles: the kernels never read those entries for the
# attention, yet a NaN or +inf there must raise as the reference's check does.
_SKIPPING = {
    "causal-kv-lengths": dict(causal=True, kv_lengths=[17, 31]),
    "window": dict(window_size=(3, 1)),
    "mask-none-kept": dict(mask=np.zeros((23, 31), bool)),
    "plain": {},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "bias_name", ["full", "nm", "1h1m-keypad", "bhn1", "b1n1", "scalar", "fortran", "full-mT", "nm-mT"]
)
@pytest.mark.parametrize("skipping", list(_SKIPPING))
def test_bias_values_checked(small_tiles, dtype, bias_name, skipping):
    """NaN or +inf anywhere in the bias raises, forward and backward; -inf does not.

    ``cpu.prepare`` leaves the check to the kernel plan, which checks the
    bias's distinct entries (also those of the tiles a mask skips). Every
    entry of the caller's array is tried, or 24 of them at random and the
    corners.
    """
    q, k, v, dout = make_inputs(dtype)
    opts = _SKIPPING[skipping]
    if bias_name == "fortran":
        base = np.asfortranarray(BIASES["full"])
    elif bias_name.endswith("-mT"):  # queries contiguous
        base = laid_out(BIASES[bias_name[:-3]], "queries-contiguous")
    else:
        base = BIASES[bias_name]
    base = np.array(base, dtype=dtype, order="K")
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", bias=base, **opts)
    rng = np.random.default_rng(len(bias_name) * 7 + len(skipping))
    flat = list(range(base.size))
    if base.size > 30:
        flat = [0, base.size - 1] + list(rng.choice(base.size, 24, replace=False))
    for n, at in enumerate(flat):
        bad_value = (np.nan, np.inf)[n % 2]
        for value, raises in ((bad_value, True), (-np.inf, False)):
            bias = base.copy(order="K")
            bias[np.unravel_index(at, bias.shape)] = value
            problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes, **opts)
            assert problem.bias_unchecked  # not checked before the kernel plan
            if raises:
                with pytest.raises(ValueError, match="`bias` contains NaN or \\+inf"):
                    cpu.forward(problem)
                with pytest.raises(ValueError, match="`bias` contains NaN or \\+inf"):
                    cpu.backward(problem, dout, out, lse)
            else:
                cpu.forward(problem)
                cpu.backward(problem, dout, out, lse)


def test_bias_values_checked_before_conversion():
    # a float64 bias beyond the float32 range is finite: the float32 kernels
    # convert it, so its values are checked on the caller's array, before
    q, k, v, _ = make_inputs(np.float32)
    bias = np.zeros((23, 31))
    bias[3, 4] = np.nan
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
    with pytest.raises(ValueError, match="`bias` contains NaN"):
        cpu.forward(problem)
    bias[3, 4] = 1e300
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
    with pytest.raises(ValueError, match="`bias` has finite entries beyond the range of float32"):
        cpu.forward(problem)
    bias[3, 4] = -1e300  # -inf once converted: removes the entry, as a float32 score would
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
    cpu._prefill.plan.kernel_options(problem, False, np.dtype(np.float32))  # no error
    # no check at all when the caller asks for none
    bias[3, 4] = np.nan
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes, check_finite=False)
    assert not problem.bias_unchecked
    cpu._prefill.plan.kernel_options(problem, False, np.dtype(np.float32))  # no error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["full", "nm", "b11m-keypad", "bhn1", "scalar"])
def test_modifiers_inputs_unmodified_and_deterministic(small_tiles, monkeypatch, dtype, bias_name):
    monkeypatch.setattr(cpu._runtime.config, "DQ_SHARES_BYTES", 4000)  # a few chunks of key tiles
    q, k, v, dout = make_inputs(dtype)
    bias = BIASES[bias_name].astype(dtype)
    slopes = ALIBI_BH.copy()
    opts = dict(bias=bias, alibi_slopes=slopes, softcap=1.5, causal=True, tau=0.7, nvm=True)
    inputs = (q, k, v, dout, bias, slopes)
    check_unmodified_and_deterministic(q, k, v, dout, opts, inputs, "dbias")

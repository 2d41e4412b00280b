"""`elastic_np.cpu._tiles.transpose.transpose_add`, `transpose_store`, `transpose_stream` and `prefetch`: exact against NumPy."""

import numpy as np
import pytest
from numba import njit

from elastic_np.cpu._tiles.transpose import (
    prefetch, stream_fence, stream_width, transpose_accumulate, transpose_add, transpose_store,
    transpose_stream, transpose_width,
)


@njit(cache=True)
def _add_blocks(x, src, start, stride, blocks_r, blocks_c, scale):
    width = transpose_width(x)
    for cb in range(blocks_c):
        for rb in range(blocks_r):
            prefetch(src, start + (rb + 1) * width * stride)  # past the end is harmless
            transpose_add(x, src, start + rb * width * stride + cb * width, stride,
                          cb * width, rb * width, scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_add_matches_numpy(dtype):
    width = transpose_width(dtype)
    rng = np.random.default_rng(0)
    rows, cols, lead = 3 * width, 2 * width, 5 * width + 3  # src rows lead elements apart
    src = rng.standard_normal(rows * lead + 7).astype(dtype)
    x = rng.standard_normal((cols + 1, rows + 2)).astype(dtype)
    expected = x.copy()
    start = 7
    block = src[start : start + rows * lead].reshape(rows, lead)[:, :cols]
    scale = dtype(0.75)
    expected[:cols, :rows] += scale * block.T
    src_before = src.copy()
    _add_blocks(x, src, start, lead, 3, 2, scale)
    np.testing.assert_array_equal(x, expected)  # one product and one sum per entry
    np.testing.assert_array_equal(src, src_before)


@njit(cache=True)
def _store_blocks(x, dst, start, stride, blocks_r, blocks_c, scale, stream):
    """Blocks of W x W (`transpose_store`), or of W x L (`transpose_stream`)."""
    width = transpose_width(x)
    cols = stream_width(x) if stream else width
    for cb in range(blocks_c):
        for rb in range(blocks_r):
            at = start + rb * width * stride + cb * cols
            if stream:
                transpose_stream(x, dst, at, stride, cb * cols, rb * width, scale)
            else:
                transpose_store(x, dst, at, stride, cb * cols, rb * width, scale)
    if stream:
        stream_fence()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_store_matches_numpy(dtype):
    width = transpose_width(dtype)
    rng = np.random.default_rng(1)
    rows, cols, lead = 2 * width, 3 * width, 4 * width + 5
    x = rng.standard_normal((cols + 2, rows + 1)).astype(dtype)
    dst = np.full(rows * lead + 9, np.nan, dtype=dtype)
    start, scale = 5, dtype(1.25)
    _store_blocks(x, dst, start, lead, 2, 3, scale, False)
    view = dst[start : start + rows * lead].reshape(rows, lead)
    np.testing.assert_array_equal(view[:, :cols], scale * x[:cols, :rows].T)
    assert np.isnan(view[:, cols:]).all() and np.isnan(dst[:start]).all()  # nothing else written


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_stream_writes_whole_lines_as_numpy(dtype):
    width, line = transpose_width(dtype), stream_width(dtype)
    # runs of whole 64-byte lines, L / W blocks of W x W side by side
    assert line % width == 0 and line * np.dtype(dtype).itemsize % 64 == 0
    rng = np.random.default_rng(5)
    rows, cols, lead = 2 * width, 2 * line, 3 * line
    x = rng.standard_normal((cols + 3, rows + 2)).astype(dtype)
    buffer = np.full(rows * lead + 4 * line, np.nan, dtype=dtype)
    first = (-buffer.ctypes.data // buffer.itemsize) % line  # dst[start] on a line
    dst = buffer[first:]
    start, scale = line, dtype(-0.75)
    _store_blocks(x, dst, start, lead, 2, 2, scale, True)
    view = dst[start : start + rows * lead].reshape(rows, lead)
    np.testing.assert_array_equal(view[:, :cols], scale * x[:cols, :rows].T)
    assert np.isnan(view[:, cols:]).all() and np.isnan(dst[:start]).all()  # nothing else written
    assert np.isnan(dst[start + rows * lead :]).all()


@njit(cache=True)
def _accumulate_blocks(x, dst, start, stride, blocks_r, blocks_c, scale):
    width = transpose_width(x)
    for cb in range(blocks_c):
        for rb in range(blocks_r):
            transpose_accumulate(x, dst, start + rb * width * stride + cb * width, stride,
                                 cb * width, rb * width, scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_accumulate_adds_in_float64(dtype):
    width = transpose_width(dtype)
    rng = np.random.default_rng(4)
    rows, cols, lead = 3 * width, 2 * width, 3 * width + 7
    x = rng.standard_normal((cols + 1, rows + 3)).astype(dtype)
    dst = rng.standard_normal(rows * lead + 4)  # float64 whatever the dtype of x
    before = dst.copy()
    start, scale = 4, 1.0 / 3.0
    _accumulate_blocks(x, dst, start, lead, 3, 2, scale)
    expected = before.copy()
    view = expected[start : start + rows * lead].reshape(rows, lead)
    # one float64 product and one sum per entry, as the kernel's scalar edges
    view[:, :cols] += x[:cols, :rows].T.astype(np.float64) * scale
    np.testing.assert_array_equal(dst, expected)  # nothing else written either


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_width_is_the_same_in_jit_code(dtype):
    @njit
    def width_of(x):
        return transpose_width(x)

    x = np.zeros(3, dtype)
    assert width_of(x) == transpose_width(x) == transpose_width(dtype)
    assert transpose_width(dtype) >= 8

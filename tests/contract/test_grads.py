"""`elastic_np._contract._grads.sum_to_shape`: its short ways give the bits of the general reduction."""

import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from elastic_np._contract._grads import reduce_to_shape, sum_to_shape

FLOATS = st.floats(-1e300, 1e300, allow_nan=False, width=64) | st.sampled_from([0.0, -0.0, 1e-310, -1e-310])


@settings(max_examples=400, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40), elements=FLOATS),
       st.booleans())
def test_a_gradient_summed_to_a_scalar_has_the_bits_of_the_axes_sum(grad, transposed):
    grad = grad.T if transposed else grad  # a strided gradient too
    want = float(reduce_to_shape(grad, ()))
    got = sum_to_shape(grad, ())
    assert type(got) is float
    assert np.array_equal(np.float64(got), np.float64(want), equal_nan=True)
    assert np.signbit(got) == np.signbit(want)


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 9)), elements=st.floats(-10, 10, width=32)))
def test_a_gradient_of_the_parameters_shape_is_kept_in_float64(grad):
    got = sum_to_shape(grad, grad.shape)
    assert got.dtype == np.float64 and got.shape == grad.shape
    np.testing.assert_array_equal(got, grad.astype(np.float64))
    assert sum_to_shape(np.float32(2.5), ()) == 2.5


def test_broadcast_gradients_still_sum_over_their_axes():
    grad = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(sum_to_shape(grad, (3, 1)), grad.sum(axis=(0, 2)).reshape(3, 1))
    assert sum_to_shape(grad, ()) == float(grad.sum())

"""elastic_np.testing.gradcheck on functions with known gradients."""

import numpy as np
import pytest

from elastic_np.testing import GradcheckError, gradcheck


def test_passes_a_correct_gradient_of_arrays_and_scalars():
    x = np.array([[0.5, -1.0], [2.0, 0.25]])
    a = 1.5
    dout = np.array([[1.0, -2.0], [0.5, 3.0]])
    report = gradcheck(lambda x, a: a * np.sin(x), {"x": x, "a": a},
                       {"x": dout * a * np.cos(x), "a": float(np.sum(dout * np.sin(x)))}, dout=dout)
    assert report and all(e.error < 1e-8 for e in report.entries)


def test_names_the_worst_element_of_a_wrong_gradient():
    x = np.array([0.5, -1.0, 2.0])
    wrong = 3 * x**2
    wrong[2] *= 1.001
    with pytest.raises(GradcheckError) as info:
        gradcheck(lambda x: x**3, {"x": x}, {"x": wrong})
    message = str(info.value)
    assert "(2,)" in message and "NO" in message
    report = gradcheck(lambda x: x**3, {"x": x}, {"x": wrong}, raise_on_failure=False)
    assert not report and report.entries[0].index == (2,)
    assert report.entries[0].claimed == pytest.approx(12.012) and report.entries[0].numerical == pytest.approx(12.0)


def test_rejects_nan_gradient_and_bad_shapes():
    x = np.array([1.0, 2.0])
    assert not gradcheck(lambda x: x**2, {"x": x}, {"x": np.array([2.0, np.nan])}, raise_on_failure=False)
    with pytest.raises(ValueError, match="shape"):
        gradcheck(lambda x: x**2, {"x": x}, {"x": np.ones(3)})
    with pytest.raises(ValueError, match="`claimed`"):
        gradcheck(lambda x: x**2, {"x": x}, {"y": x})
    with pytest.raises(ValueError, match="`dout`"):
        gradcheck(lambda x: x**2, {"x": x}, {"x": 2 * x}, dout=np.ones(3))


def test_inputs_are_not_modified():
    x = np.array([1.0, 2.0])
    x.setflags(write=False)
    gradcheck(lambda x: x**2, {"x": x}, {"x": 2 * x})
    np.testing.assert_array_equal(x, [1.0, 2.0])

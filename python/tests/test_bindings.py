"""fusekit._C without PyTorch: arrays from NumPy through DLPack, the errors, the build."""
import pytest

np = pytest.importorskip("numpy")
import fusekit
from fusekit import _C


def test_build_info():
    info = fusekit.build_info()
    assert info["version"] == fusekit.__version__
    assert isinstance(info["cuda"], bool)


def test_softmax_on_numpy_arrays_matches_the_math():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 33)).astype(np.float32)
    y = np.empty_like(x)
    _C.softmax(x, y, 0)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_bias_act_on_a_row_strided_view():
    # Columns 0..4 of a [3, 8] buffer: a row stride of 8, as the C++ op takes it.
    buf = np.arange(24, dtype=np.float32).reshape(3, 8) - 12
    x = buf[:, :5]
    b = np.full(5, 0.5, dtype=np.float32)
    y = np.empty((3, 5), dtype=np.float32)
    _C.bias_act_forward(x, None, b, y, None, "relu", 1.0, 0)
    np.testing.assert_array_equal(y, np.maximum(x + 0.5, 0))


def test_errors_name_the_op_and_the_argument():
    x = np.zeros((4, 5), dtype=np.float32)
    with pytest.raises(fusekit.Error, match=r"fk::bias_act_forward: argument 'bias': expected shape \[5\], got \[4\]"):
        _C.bias_act_forward(x, None, np.zeros(4, dtype=np.float32), np.empty_like(x), None, "relu", 1.0, 0)
    with pytest.raises(fusekit.Error, match=r"argument 'x'.*float32, float16, bfloat16"):
        _C.softmax(np.zeros((2, 2), dtype=np.float64), np.zeros((2, 2), dtype=np.float64), 0)
    with pytest.raises(fusekit.Error, match=r"activation"):
        _C.bias_act_forward(x, None, None, np.empty_like(x), None, "swish", 1.0, 0)
    assert issubclass(fusekit.Error, ValueError)

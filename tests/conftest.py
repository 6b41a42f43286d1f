"""Where a test runs is a marker, not a file name: each marker's tests are skipped, with the command
that runs them, where their machine or mode is missing.

* ``gpu``: a CUDA device (``bash benchmarks/run_on_gpu.sh OUT tests``, which runs ``pytest -m gpu tests``).
* ``interpreter``: Triton's CPU interpreter (``TRITON_INTERPRET=1 pytest -m interpreter tests``): the
  kernels' ``@triton.jit`` and host launch code on CPU tensors, in every CI run (``.ci/interpret.sh``).
  The interpreter computes dots and exponentials in numpy, so these tests compare against the
  references (and two launch variants that must agree bit for bit), not against GPU bits. Triton 3.6's
  interpreter does not round float -> FP8 to nearest even (84.0 became 88, not 80), so FP8 outputs'
  bits are checked on a GPU only.
* ``sm90``: compiles kernels for the H100/H200's sm_90 without a GPU (``JETRL_COMPILE_SM90=1 pytest -m
  sm90 tests``; tests/kernels/_sm90.py).

Test folders mirror the packages and are not packages themselves, so test files have unique basenames
(pytest's default import mode). Shared helpers sit here, in tests/, which is put on ``sys.path``; a
helper used by one folder only sits in that folder (pytest puts a test file's folder on the path).
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _skip_reason(item) -> str | None:
    triton = importlib.util.find_spec("triton") is not None
    if "gpu" in item.keywords and not torch.cuda.is_available():
        return "needs a CUDA device (bash benchmarks/run_on_gpu.sh OUT tests)"
    if "interpreter" in item.keywords and (os.environ.get("TRITON_INTERPRET") != "1" or not triton):
        return "needs Triton's interpreter: TRITON_INTERPRET=1 pytest -m interpreter tests, Triton installed (.ci/interpret.sh)"
    if "sm90" in item.keywords and (
        os.environ.get("JETRL_COMPILE_SM90") != "1" or not triton or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        return "needs Triton and no TRITON_INTERPRET: JETRL_COMPILE_SM90=1 pytest -m sm90 tests (.ci/interpret.sh)"
    return None


def pytest_collection_modifyitems(config, items):
    # Tests are skipped by capability, never deleted.
    for item in items:
        reason = _skip_reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _interpreter_scalar_loop_bounds(request, monkeypatch):
    """Triton 3.6's interpreter turns a scalar into a loop bound with ``int()`` of a one-element array,
    which NumPy 2.4 refuses; the attention kernel's trip count is such a scalar (read from the row's
    length). Its element is what the compiled kernel uses."""
    if request.node.get_closest_marker("interpreter") is not None:
        from triton.runtime import interpreter

        patch = interpreter._patch_lang_tensor

        def patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
    yield


@pytest.fixture(autouse=True)
def _interpreter_dots_summed_in_an_order_k_fixes(request, monkeypatch):
    """The interpreter's ``tl.dot`` is ``np.matmul``, a BLAS call whose summation order follows the tile's
    shape: with numpy 2.4.6's OpenBLAS a wide tile's FP32 sums differed from a narrow one's, so the tests
    that two launch shapes agree failed in the interpreter while passing on the H100. A GPU's MMA sums each
    output over K in an order K alone fixes; ``np.einsum`` without BLAS sums each output over K in order,
    so the interpreter's dots get that property (and their values, not the GPU's bits, as before)."""
    if request.node.get_closest_marker("interpreter") is not None:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            a_data, b_data = a.data, b.data
            if any(x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating() for x in (a, b)):  # FP8: as Triton does
                a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
                b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
            acc = d.data.dtype
            product = np.einsum("...ik,...kj->...ij", a_data.astype(acc), b_data.astype(acc), optimize=False)
            return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield


@pytest.fixture
def one_thread():
    # Models this small gain nothing from a second thread, and OpenMP threads that spin on a
    # shared, busy machine made the warm start 10x slower (docs/tasks.md). One thread keeps the
    # test's time independent of what else runs.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _kernel_caches_per_test():
    # The kernels resolve JETRL_GEMM_BACKEND / JETRL_DISABLE_TRITON and the backend order once per
    # process; set up first, this runs last, after monkeypatch has restored the environment.
    yield
    from jetrl_trainer.kernels import reset_kernel_caches

    reset_kernel_caches()

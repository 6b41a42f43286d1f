import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests are skipped by capability, never deleted.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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

import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_ROOT = os.environ.get("MDGAN_DATA_ROOT", os.path.join(os.path.dirname(REPO), "shared", "data"))
HAVE_MNIST = os.path.isdir(os.path.join(DATA_ROOT, "MNIST", "raw"))

# The same arithmetic in every test process as in the services (one intra-op thread).
torch.set_num_threads(1)

CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device here (CI has none): scripts/gpu_check.sh runs the CUDA cases on a GPU"
# A test that trains takes `device`: its CPU case everywhere, its CUDA case (marked `cuda`) where CUDA is.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason=NO_CUDA)])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def cuda_only(test):
    """A test that needs CUDA (marked `cuda`; skipped with its reason elsewhere)."""
    return pytest.mark.cuda(pytest.mark.skipif(not CUDA, reason=NO_CUDA)(test))


def python() -> str:
    return sys.executable


@pytest.fixture
def mnist_root() -> str:
    if not HAVE_MNIST:
        if os.environ.get("CI"):
            pytest.fail(f"MNIST is missing under {DATA_ROOT} (CI needs ../shared/data)")
        pytest.skip(f"MNIST not found under {DATA_ROOT}")
    return DATA_ROOT


def pytest_collection_modifyitems(config, items):
    """Slow tests first (stable otherwise): with several test processes (-n), the long ones start early and
    the short ones fill the gaps, instead of one long test running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

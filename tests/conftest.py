import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skip them, saying why, on machines without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run the GPU suite: see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """xdist runs one worker per core: a second torch thread per worker would only oversubscribe
    the cores (tiny-model tests slowed about tenfold that way on a shared 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

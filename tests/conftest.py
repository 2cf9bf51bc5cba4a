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

"""lmfs: language models from scratch.

The package behind the lecture notebooks in ``lectures/``. Every real implementation the
lectures use lives here, one module per idea; notebooks display it with :func:`lmfs.show`.
"""

import os as _os

import torch as _torch

# Without a CUDA GPU, Triton kernels run through Triton's interpreter, and Triton reads this switch
# when it is first imported (torch.compile imports it too), so it is set before anything else can.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from lmfs.env import __version__, banner, resolve_device, resolve_scale, seed_everything, setup
from lmfs.show import show

__all__ = ["banner", "resolve_device", "resolve_scale", "seed_everything", "setup", "show"]

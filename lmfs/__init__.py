"""lmfs: language models from scratch.

The package behind the lecture notebooks in ``lectures/``. Every real implementation the
lectures use lives here, one module per idea; notebooks display it with :func:`lmfs.show`.
"""

# lmfs.env comes first: without a CUDA GPU it sets TRITON_INTERPRET=1 (Triton's interpreter switch)
# before anything in lmfs can import Triton.
from lmfs.env import __version__, banner, resolve_device, resolve_scale, seed_everything, setup
from lmfs.show import show

__all__ = ["banner", "resolve_device", "resolve_scale", "seed_everything", "setup", "show"]

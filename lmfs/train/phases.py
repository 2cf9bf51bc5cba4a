"""Where a training step's time goes: wall seconds per phase, each second counted once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch


class PhaseTimer:
    """Wall seconds per phase of a step (``phases``: their names). ``with timer.phase(name):`` adds its block's seconds to
    ``seconds[name]``; a phase entered inside another pauses the outer one, so every second is
    counted in exactly one phase. With ``sync`` (the default) it waits for the device's queued work
    at both ends, so the block's device work is inside it; without, it times the host only (for a
    phase run while the device still computes another)."""

    def __init__(self, phases: Sequence[str], device: torch.device | str | None = None):
        self.phases, self.device = tuple(phases), torch.device(device or "cpu")
        self.seconds, self._open = dict.fromkeys(self.phases, 0.0), []

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str, sync: bool = True):
        if name not in self.seconds:
            raise ValueError(f"phase={name!r} is not one of {self.phases}")
        if sync:
            self._wait()
        now = time.perf_counter()
        if self._open:                                  # the outer phase's time stops here ...
            outer, since = self._open[-1]
            self.seconds[outer] += now - since
        self._open.append([name, now])
        try:
            yield
        finally:
            if sync:
                self._wait()
            now = time.perf_counter()
            inner, since = self._open.pop()
            self.seconds[inner] += now - since
            if self._open:                              # ... and goes on from here
                self._open[-1][1] = now

    def reset(self) -> dict[str, float]:
        """The seconds counted since the last reset, and a fresh count."""
        seconds, self.seconds = self.seconds, dict.fromkeys(self.phases, 0.0)
        return seconds

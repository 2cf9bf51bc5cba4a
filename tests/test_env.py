import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import lmfs
from lmfs.env import SCALES, banner, default_dtype, resolve_device, resolve_scale, seed_everything, setup


def test_scale_resolution(monkeypatch):
    monkeypatch.delenv("LMFS_SCALE", raising=False)
    assert resolve_scale("auto") == ("full" if torch.cuda.is_available() else "smoke")
    monkeypatch.setenv("LMFS_SCALE", "full")
    assert resolve_scale("auto") == "full"
    assert resolve_scale("smoke") == "smoke"  # an explicit value beats the environment
    assert resolve_scale(" FULL ") == "full"


def test_unknown_scale_lists_valid_ones(monkeypatch):
    with pytest.raises(ValueError) as err:
        resolve_scale("huge")
    assert all(s in str(err.value) for s in SCALES)
    monkeypatch.setenv("LMFS_SCALE", "tiny")
    with pytest.raises(ValueError, match="smoke"):
        resolve_scale("auto")


def test_device_resolution(monkeypatch):
    monkeypatch.setenv("LMFS_DEVICE", "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="choose one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_seed_everything_reproduces_all_generators():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    seed_everything(123)
    first = draw()
    seed_everything(123)
    assert draw() == first
    seed_everything(124)
    assert draw() != first


def test_setup_and_banner(capsys):
    ctx = setup("smoke", "cpu", seed=3)
    assert (ctx.scale, ctx.device, ctx.dtype, ctx.seed) == ("smoke", torch.device("cpu"), torch.float32, 3)
    printed = capsys.readouterr().out
    assert torch.__version__ in printed and lmfs.__version__ in printed and "scale: smoke" in printed
    assert "cpu" in banner("smoke", torch.device("cpu"))


@pytest.mark.gpu
def test_cuda_is_chosen_on_a_gpu(monkeypatch):
    monkeypatch.delenv("LMFS_DEVICE", raising=False)
    monkeypatch.delenv("LMFS_SCALE", raising=False)
    assert resolve_device("auto").type == "cuda"
    assert resolve_scale("auto") == "full"
    assert default_dtype("cuda") == torch.bfloat16
    assert torch.cuda.get_device_name() in banner("full", torch.device("cuda"))


def test_kernel_environment_drops_the_switch_lmfs_set(monkeypatch):
    """Kernels started inside kernel_environment see TRITON_INTERPRET as the user had it."""
    import os

    import lmfs.env

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for user_value in (None, "0"):
        monkeypatch.setattr(lmfs.env, "USER_TRITON_INTERPRET", user_value)
        with lmfs.env.kernel_environment():
            assert os.environ.get("TRITON_INTERPRET") == user_value
        assert os.environ["TRITON_INTERPRET"] == "1"


def test_peak_memory_files_add_up(tmp_path):
    from lmfs.env import read_peak_memory

    assert read_peak_memory(tmp_path) == (None, 0)
    (tmp_path / "1.json").write_text('{"pid": 1, "reserved_bytes": 1073741824}')
    (tmp_path / "2.json").write_text('{"pid": 2, "reserved_bytes": 536870912}')
    assert read_peak_memory(tmp_path) == (1.5, 2)


def test_a_kernel_records_its_peak_after_each_cell(tmp_path, monkeypatch):
    # A kernel killed at shutdown never runs its at-exit handlers: the peak is written after each cell.
    import IPython
    import torch

    import lmfs.env

    callbacks = []
    shell = SimpleNamespace(events=SimpleNamespace(register=lambda event, fn: callbacks.append((event, fn))))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setenv(lmfs.env.PEAK_DIR_VAR, str(tmp_path))
    for name, value in (("is_available", True), ("is_initialized", True), ("device_count", 1)):
        monkeypatch.setattr(torch.cuda, name, lambda v=value: v)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda i: 3 * 2**30)
    lmfs.env._record_after_each_cell()
    assert [event for event, _ in callbacks] == ["post_run_cell"]
    assert lmfs.env.read_peak_memory(tmp_path) == (None, 0)
    callbacks[0][1](None)   # a cell ran
    assert lmfs.env.read_peak_memory(tmp_path) == (3.0, 1)


def test_memory_cap_is_checked_and_only_applies_to_cuda(monkeypatch):
    import torch

    from lmfs.env import MEMORY_CAP_VAR, apply_memory_cap

    monkeypatch.delenv(MEMORY_CAP_VAR, raising=False)
    assert apply_memory_cap(torch.device("cpu")) is None
    monkeypatch.setenv(MEMORY_CAP_VAR, "22")
    assert apply_memory_cap(torch.device("cpu")) is None
    if torch.cuda.is_available():
        for bad in ("lots", "-1"):
            monkeypatch.setenv(MEMORY_CAP_VAR, bad)
            with pytest.raises(ValueError, match=MEMORY_CAP_VAR):
                apply_memory_cap(torch.device("cuda"))


def test_autocast_falls_back_to_float32_without_bfloat16(monkeypatch):
    import torch

    import lmfs.train.loop as loop

    cuda = torch.device("cuda")
    monkeypatch.setattr(loop, "default_dtype", lambda device: torch.float32)
    assert loop.resolve_autocast("auto", cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "an old GPU")
    with pytest.raises(ValueError, match="no bfloat16"):
        loop.resolve_autocast("bf16", cuda)
    monkeypatch.setattr(loop, "default_dtype", lambda device: torch.bfloat16)
    assert loop.resolve_autocast("auto", cuda) is torch.bfloat16

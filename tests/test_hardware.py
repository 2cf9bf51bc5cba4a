"""lmfs.hardware: the datasheet table, its lookups and the stored measurements."""


import pytest
import torch

from lmfs.hardware import GPUS, TPUS, for_device, gpu


def test_every_entry_is_complete_and_sourced():
    for name, chip in {**GPUS, **TPUS}.items():
        assert chip.name == name
        assert set(chip.flops) == {"fp32", "tf32", "bf16", "fp16", "fp8"}, name
        assert chip.hbm_bandwidth > 0 and chip.memory_bytes > 0, name
        assert "datasheet" in chip.source or "documentation" in chip.source, name
    for name, chip in GPUS.items():
        assert chip.sm_count and chip.interconnect_bandwidth and chip.pcie_bandwidth, name
        assert chip.max_smem_per_sm < chip.l1_smem_per_sm <= chip.registers_per_sm, name
        rates = [chip.flops[d] for d in ("fp32", "tf32", "bf16") if chip.flops[d]]
        assert rates == sorted(rates), name  # tensor cores are faster than plain fp32
        if chip.flops["bf16"]:
            assert chip.flops["bf16"] == chip.flops["fp16"], name
        if chip.flops["fp8"]:
            assert chip.flops["fp8"] == 2 * chip.flops["bf16"], name


def test_datasheet_figures_by_hand():
    # The H100/H200 datasheets print 1,979 TFLOP/s bf16 "with sparsity": dense is half.
    assert gpu("H100").peak("bf16") == gpu("H200").peak("bf16") == 989.5e12
    assert gpu("A100").peak("bf16") == 312e12 and gpu("B200").peak("bf16") == 2.25e15
    assert (gpu("H200").memory_bytes, gpu("H200").hbm_bandwidth, gpu("H200").sm_count) == (141e9, 4.8e12, 132)
    # Ridge points: 989.5 / 3.35 = 295.4 and 989.5 / 4.8 = 206.1 FLOPs per byte.
    assert gpu("H100").ridge_point() == pytest.approx(295.37, abs=0.01)
    assert gpu("H200").ridge_point() == pytest.approx(206.15, abs=0.01)
    assert gpu("V100").ridge_point("fp16") == pytest.approx(125e12 / 900e9)
    with pytest.raises(ValueError, match="no bf16"):
        gpu("V100").peak("bf16")
    with pytest.raises(KeyError, match="unknown dtype"):
        gpu("H100").peak("fp64")


def test_lookup_by_device_name():
    assert gpu("H200") is GPUS["H200"]
    assert gpu("NVIDIA H100 80GB HBM3").name == "H100"
    assert gpu("NVIDIA A100-SXM4-80GB").name == "A100"
    assert gpu("nvidia b200").name == "B200"
    assert gpu("Tesla V100-SXM2-32GB").name == "V100"
    with pytest.raises(KeyError, match="knows V100, A100, H100, H200, B200"):
        gpu("NVIDIA GeForce RTX 4090")
    assert for_device("cpu") is None and for_device(torch.device("cpu")) is None


@pytest.mark.gpu
def test_this_gpu_matches_its_datasheet():
    chip = for_device()
    name = torch.cuda.get_device_name()
    if chip is None:
        pytest.fail(f"no lmfs.hardware entry for {name}: add one (with its source) to lmfs.hardware.GPUS")
    props = torch.cuda.get_device_properties(0)
    assert props.multi_processor_count == chip.sm_count
    # The datasheet's "141 GB" and what the driver reports differ by rounding and reserved memory.
    assert 0.85 < props.total_memory / chip.memory_bytes < 1.10

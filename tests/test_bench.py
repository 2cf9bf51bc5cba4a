"""lmfs.bench: timing, probes, the roofline and wave-quantisation models, the command line."""

import math
import time

import matplotlib
import pytest
import torch

from lmfs.benchmarks.__main__ import BENCHMARKS
from lmfs.benchmarks.__main__ import main as bench_main
from lmfs.bench.probes import copy_bandwidth, matmul_rate, strided_copy_bandwidth
from lmfs.bench.roofline import (arithmetic_intensity, attainable_flops, matmul_intensity, plot_roofline,
                                 predicted_matmul_rate, ridge_point, tile_waves)
from lmfs.bench.timing import Timing, benchmark, device_timeline, profile_table, timeline_of

matplotlib.use("Agg")

# ----------------------------------------------------------------------------------------------
# Timing


def test_timing_statistics():
    t = Timing((0.001, 0.002, 0.003, 0.004, 0.010), "perf_counter")
    assert t.median == 0.003
    assert t.iqr > 0 and t.spread == pytest.approx(t.iqr / 0.003)
    assert t.rate(6e9) == pytest.approx(2e12)
    assert "ms" in str(t) and "n=5" in str(t)
    assert Timing((0.5,), "perf_counter").iqr == 0.0


def test_benchmark_warms_up_then_times_each_repeat_on_cpu():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    t = benchmark(fn, warmup=2, repeats=5, device="cpu")
    assert len(calls) == 7 and len(t.times) == 5 and t.method == "perf_counter"
    assert 0.002 <= t.median < 0.5  # slept 2 ms; a loaded machine may add some


def test_benchmark_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats"):
        benchmark(lambda: None, repeats=0, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            benchmark(lambda: None, device="cuda")


def test_profile_table_lists_what_ran():
    x = torch.randn(64, 64, device="cuda" if torch.cuda.is_available() else "cpu")
    table = profile_table(lambda: torch.tanh(x @ x) + 1, warmup=1, repeats=2)
    assert list(table.columns) == ["name", "calls", "total_us", "mean_us", "share", "kind"]
    assert len(table) > 0 and (table["total_us"] >= 0).all()
    assert table["share"].sum() <= 1 + 1e-9
    kinds = table.attrs["kinds_us"]  # every row counted once, in one kind
    assert sum(kinds.values()) == pytest.approx(table["total_us"].sum() / table["share"].sum())
    assert kinds["matmul"] > 0  # x @ x
    if not torch.cuda.is_available():
        assert any("aten::" in name for name in table["name"])


def _trace(ranges, kernels, ops):
    """Chrome-trace events as torch.profiler writes them (µs)."""
    return ([{"cat": "user_annotation", "name": f"part/{n}", "ts": a, "dur": b - a} for n, a, b in ranges]
            + [{"cat": "kernel", "name": "k", "ts": a, "dur": b - a} for a, b in kernels]
            + [{"cat": "cpu_op", "name": n, "ts": a, "dur": b - a} for n, a, b in ops])


def test_timeline_of_a_hand_made_trace():
    events = _trace([("(run)", 0, 1000), ("a", 100, 300), ("a", 500, 600), ("b", 150, 200)],
                    [(0, 60), (120, 180), (250, 400), (550, 560), (900, 950), (130, 170)],
                    [("aten::x", 60, 110), ("aten::copy_", 60, 80), ("aten::y", 400, 450)])
    t = timeline_of(events, ["a", "b"], gaps=3)
    assert t["wall"] == pytest.approx(1.0) and t["busy"] == pytest.approx(0.33)   # overlapping kernels once
    assert t["parts"]["a"] == pytest.approx({"calls": 2, "wall": 0.3, "busy": 0.12})
    assert t["parts"]["b"] == pytest.approx({"calls": 1, "wall": 0.05, "busy": 0.03})
    # the three longest idle stretches, in time order; (180, 250) lies in part a (then b, which ended)
    assert [(g["at"], g["ms"], g["part"]) for g in t["gaps"]] == [
        (pytest.approx(0.18), pytest.approx(0.07), "a"), (pytest.approx(0.4), pytest.approx(0.15), "(run)"),
        (pytest.approx(0.56), pytest.approx(0.34), "(run)")]
    assert t["gaps"][1]["ops"] == {"aten::y": pytest.approx(0.05)}
    first = timeline_of(events, ["a"], gaps=5)["gaps"][0]      # the outermost operator only, not its copy_
    assert first["part"] == "(run)" and first["ops"] == {"aten::x": pytest.approx(0.05)}


def test_timeline_busy_time_equals_a_brute_force_count():
    import random
    rng = random.Random(0)
    kernels = [(s, s + rng.randrange(1, 30)) for s in sorted(rng.sample(range(2000), 80))]
    spans = sorted(rng.sample(range(2000), 20))
    parts = [("p", a, b) for a, b in zip(spans[::2], spans[1::2])]
    t = timeline_of(_trace([("(run)", 0, 2100), *parts], kernels, []), ["p"])
    covered = {x for a, b in kernels for x in range(a, b)}                      # busy µs, counted one by one
    inside = sum(1 for _, a, b in parts for x in range(a, b) if x in covered)
    assert t["busy"] == pytest.approx(len(covered) / 1e3)
    assert t["parts"]["p"]["busy"] == pytest.approx(inside / 1e3)


def test_device_timeline_wraps_methods_and_puts_them_back():
    class Work:
        def step(self, x):
            return (x * 2).sum()

    w = Work()
    w.other = w.step        # an instance attribute already there comes back as it was
    before = w.other
    t = device_timeline(lambda: [w.step(torch.ones(4)), w.other(torch.ones(4))],
                        {"step": (w, "step"), "other": (w, "other")})
    assert t["parts"]["step"]["calls"] == 1 and t["parts"]["other"]["calls"] == 1
    assert "step" not in vars(w) and w.other is before
    assert t["wall"] >= t["parts"]["step"]["wall"] > 0
    if not torch.cuda.is_available():
        assert t["busy"] is None and t["gaps"] == []


def test_kernel_kinds_of_names_seen_on_an_h200():
    from lmfs.bench.timing import kernel_kind

    seen = {  # from the training benchmark's profile (torch 2.11, CUDA 13, cuDNN 9.19)
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1": "attention",
        "_attn_fwd": "attention",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>":
            "optimizer",
        "triton_poi_fused__scaled_dot_product_cudnn_attention_permute_3": "other",  # a copy named after its op
        "triton_per_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_6": "other",
        "Memset (Device)": "other",
    }
    assert {name: kernel_kind(name) for name in seen} == seen


# ----------------------------------------------------------------------------------------------
# Probes (tiny on the CPU: they exercise the code, the numbers mean little)


def test_probes_on_cpu_return_positive_rates():
    assert copy_bandwidth(n_bytes=2**20, device="cpu", repeats=3) > 0
    assert strided_copy_bandwidth(4, n_elements=2**12, device="cpu", repeats=3) > 0
    assert matmul_rate(64, "fp32", device="cpu", repeats=3) > 0
    with pytest.raises(ValueError, match="unknown dtype"):
        matmul_rate(64, "fp64", device="cpu")


def test_probes_run_records_date_and_device(capsys):
    import datetime

    from lmfs.bench.probes import run

    result = run("cpu")
    assert result["date"] == datetime.date.today().isoformat() and result["device"] == "cpu"
    assert result["datasheet_bandwidth"] is None and result["matmul"]["fp32"]["datasheet"] is None
    assert result["copy_bandwidth"] > 0 and "real numbers need a CUDA GPU" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# Roofline and tile/wave quantisation


def test_wave_quantisation_hand_computed_cases():
    # 1792 = 7·256 = 14·128: 98 tiles, one wave on 108 SMs, no padding.
    tw = tile_waves(1792, 1792, tile=(256, 128), n_sm=108)
    assert (tw.tiles, tw.waves) == (98, 1)
    assert tw.wave_efficiency == pytest.approx(98 / 108)
    assert tw.tile_efficiency == 1.0
    # One more row and column: 8·15 = 120 tiles, two waves, 120 of 216 SM-slots busy.
    tw = tile_waves(1793, 1793, tile=(256, 128), n_sm=108)
    assert (tw.tiles, tw.waves) == (120, 2)
    assert tw.wave_efficiency == pytest.approx(120 / 216)
    assert tw.tile_efficiency == pytest.approx(1793 * 1793 / (2048 * 1920))
    assert tw.efficiency == pytest.approx(tw.wave_efficiency * tw.tile_efficiency)
    # Exactly one full wave, then one tile too many.
    assert tile_waves(108 * 128, 256, (256, 128), 108).efficiency == 1.0
    assert tile_waves(108 * 128 + 1, 256, (256, 128), 108).waves == 2
    with pytest.raises(ValueError, match="positive"):
        tile_waves(100, 100, (0, 128), 108)


def test_predicted_matmul_rate_dips_past_a_tile_boundary():
    peak = 312e12
    rates = predicted_matmul_rate([1792, 1793], peak, tile=(256, 128), n_sm=108)
    assert rates[0] == pytest.approx(peak * 98 / 108)
    assert rates[1] == pytest.approx(peak * 120 / 216 * 1793**2 / (2048 * 1920))  # about half

    # With a bandwidth, small matmuls sit on the memory roof: intensity n/3 FLOP/B in bf16.
    small = predicted_matmul_rate([48], peak, tile=(16, 16), n_sm=9, bandwidth=2e12)
    assert small[0] == pytest.approx(16 * 2e12)


def test_roofline_numbers():
    assert arithmetic_intensity(2e9, 1e9) == 2.0
    assert ridge_point(1000e12, 4e12) == 250.0
    assert float(attainable_flops(10.0, 1000e12, 4e12)) == 40e12  # memory-bound
    assert float(attainable_flops(1000.0, 1000e12, 4e12)) == 1000e12  # compute-bound
    assert list(attainable_flops([1.0, 1e4], 100.0, 1.0)) == [1.0, 100.0]
    assert matmul_intensity(3000, 3000, 3000, bytes_per_element=2) == pytest.approx(1000.0)


def test_plot_roofline_draws_the_roof_and_points():
    import matplotlib.pyplot as plt

    ax = plot_roofline(1000e12, 4e12, points=[("gelu", 0.5, 1.5e12), ("matmul", 2000.0, 700e12)])
    assert len(ax.lines) == 4  # roof, ridge line, two points
    assert "FLOPs / byte" in ax.get_xlabel()
    plt.close(ax.figure)


def test_lecture05_checkers_accept_right_and_reject_wrong_answers():
    from lmfs.exercises.lecture05 import check_roofline_time, check_waves

    assert check_roofline_time(lambda f, b, peak, bw: max(f / peak, b / bw)) == 4
    with pytest.raises(AssertionError, match="roofline_time: wrong result"):  # adds instead of overlapping
        check_roofline_time(lambda f, b, peak, bw: f / peak + b / bw)

    def waves(M, N, tile, n_sm):
        tiles = math.ceil(M / tile[0]) * math.ceil(N / tile[1])
        w = math.ceil(tiles / n_sm)
        return w, M * N / (tiles * tile[0] * tile[1]) * tiles / (w * n_sm)

    assert check_waves(waves) == 6
    with pytest.raises(AssertionError, match="waves: wrong result"):  # wave quantisation forgotten
        check_waves(lambda M, N, tile, n_sm: (waves(M, N, tile, n_sm)[0], M * N / (
            math.ceil(M / tile[0]) * tile[0] * math.ceil(N / tile[1]) * tile[1])))


# ----------------------------------------------------------------------------------------------
# Command line and the kernel benchmarks' CPU smoke versions


def test_bench_command_lists_and_rejects(capsys):
    assert bench_main([]) == 0
    assert "attention" in capsys.readouterr().out
    assert bench_main(["nonsense"]) == 2
    assert set(BENCHMARKS) == {"bpe", "train-step", "probes", "kernels", "attention", "collectives",
                               "data-parallel", "moe", "decode-step", "paged-attention", "inference", "sweep", "evaluation",
                               "extraction", "dedup", "grpo", "sandbox"}
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["probes", "--help"])
    assert exit_info.value.code == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU versions are benchmarks, not tests")
def test_kernel_benchmarks_smoke_on_cpu(capsys):
    from lmfs.benchmarks.triton_kernels import run_attention, run_kernels

    kernels = run_kernels()
    assert set(kernels["ops"]) == {"GeLU (tanh)", "softmax", "RMSNorm"}
    assert all(r["max_abs_diff"] < 1e-5 for table in kernels["ops"].values() for r in table.values())
    attention = run_attention(seq_lens=[40], head_dims=[16], tokens=40, heads=1)
    row = attention["rows"][0]
    assert row["max_abs_diff"] < 1e-5 and row["lmfs_fwd"] > 0 and row["naive_fwdbwd"] > 0
    assert "real numbers need a CUDA GPU" in capsys.readouterr().out
    assert kernels["date"] == attention["date"] and kernels["triton"]  # what results/ files are quoted with


# ----------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_cuda_event_timing_and_kernel_table():
    from lmfs.kernels import gelu, gelu_torch

    x = torch.randn(4096, 4096, device="cuda")
    t = benchmark(lambda: x @ x, warmup=2, repeats=5)
    assert t.method == "cuda events" and 0 < t.median < 1
    eager = profile_table(lambda: gelu_torch(x))
    fused = profile_table(lambda: gelu(x))
    assert eager.attrs["where"] == "GPU kernels"
    assert len(eager) >= 3  # eager PyTorch: one kernel per operation
    assert len(fused) < len(eager) and any("gelu" in name for name in fused["name"])  # one fused kernel


@pytest.mark.gpu
def test_measured_rates_are_below_the_datasheet():
    from lmfs.hardware import for_device

    chip = for_device()
    if chip is None:
        pytest.fail(f"no lmfs.hardware entry for {torch.cuda.get_device_name()}: add one to lmfs.hardware.GPUS")
    copy = copy_bandwidth()
    assert 0.3 * chip.hbm_bandwidth < copy < chip.hbm_bandwidth
    rate = matmul_rate(4096, "bf16")
    assert 0.2 * chip.peak("bf16") < rate < chip.peak("bf16")
    assert strided_copy_bandwidth(16) < 0.5 * strided_copy_bandwidth(1)  # uncoalesced reads waste sectors
    assert math.isfinite(rate)


# ----------------------------------------------------------------------------------------------
# The training benchmark's variants


def test_train_variants_parse():
    from lmfs.benchmarks.train_step import ABLATION, DEFAULT_VARIANTS, Variant, parse_variant, parse_variants

    assert parse_variant("fused") == Variant("fused")  # fuse_model's three switches on
    assert parse_variant("plain") == Variant("plain", projections=False, triton=False, chunked_loss=False)
    assert parse_variant("fused-loss") == Variant("fused-loss", chunked_loss=False)
    assert parse_variant("fused-proj-kern") == Variant("fused-proj-kern", projections=False, triton=False)
    assert parse_variant("plain+loss+cudnn") == Variant("plain+loss+cudnn", projections=False, triton=False,
                                                        sdpa_backend="cudnn")
    hf = parse_variant("hf-eager")
    assert hf.model == "hf" and not hf.compiled and hf.sdpa_backend == "auto"
    assert parse_variant("hf+flash").sdpa_backend == "flash"
    assert [v.name for v in parse_variants("ablation")] == ABLATION.split(",")
    assert [v.name for v in parse_variants(DEFAULT_VARIANTS)] == ["fused", "plain", "hf", "hf+flex"]
    for bad in ["gpt", "lmfs", "baseline", "hf+proj", "fused+fast", "fused proj", "fused-cudnn"]:
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)
    with pytest.raises(ValueError, match="repeat"):
        parse_variants("fused,hf,fused")


def test_train_benchmark_variants_on_cpu(tmp_path, capsys):
    import json

    from lmfs.benchmarks.train_step import main

    path = tmp_path / "train.json"
    result = main(["--steps", "2", "--device", "cpu", "--variants", "plain,fused-proj,fused+flash,hf,hf-eager",
                   "--json", str(path)])
    out = capsys.readouterr().out
    assert "real numbers need a CUDA GPU" in out and "x plain" in out
    saved = json.loads(path.read_text())
    assert saved["variants"] == ["plain", "fused-proj", "fused+flash", "hf", "hf-eager"]
    for name in saved["variants"]:
        assert saved[name]["tokens_per_s"] > 0 and not saved[name]["compiled"]  # never compiled on a CPU
    assert saved["hf"]["vs_hf"] == 1 and saved["plain"]["vs_plain"] == 1
    # Same weights, same batch: the first losses of the lmfs variants agree (fuse_model changes no function).
    assert saved["fused-proj"]["first_loss"] == pytest.approx(saved["plain"]["first_loss"], rel=1e-5)
    assert "fused_vs_best_hf" not in result and "plain_vs_best_hf" in result  # no "fused" variant ran
    result = main(["--steps", "1", "--device", "cpu", "--no-hf"])
    assert result["variants"] == ["fused", "plain"] and "hf" not in result
    result = main(["--steps", "1", "--device", "cpu"])  # the default: fused, plain, hf, hf+flex
    assert "hf+flex skipped" in capsys.readouterr().out  # FlexAttention has no CPU backward
    assert result["best_hf"] == "hf" and result["fused_vs_best_hf"] == result["fused"]["vs_hf"]
    assert result["plain_vs_best_hf"] == result["plain"]["vs_hf"]


def test_train_benchmark_variant_names():
    from lmfs.benchmarks.train_step import parse_variant

    assert parse_variant("hf+flex").hf_attention == "flex_attention"
    assert parse_variant("hf").hf_attention == "sdpa"
    assert parse_variant("plain+proj-loss").projections
    with pytest.raises(ValueError, match="does not apply"):
        parse_variant("fused+flex")  # FlexAttention is a Hugging Face switch here

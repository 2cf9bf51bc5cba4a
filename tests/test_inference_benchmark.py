"""``python -m lmfs.benchmarks inference`` runs end to end on the CPU (tiny model) and reports every
section; the pieces it measures with are checked against what they count."""

import json

import pytest
import torch

from lmfs.benchmarks import inference as bench
from lmfs.inference import KVCache


def test_benchmark_runs_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "inference.json"
    bench.main(["--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    for section in ("decode_batch1", "trace", "paged_kv", "speculative"):
        assert "error" not in result[section], (section, result[section])
    decode = result["decode_batch1"]
    assert set(decode["rows"]) == {"lmfs engine", "lmfs plain runner", "HF static cache", "HF dynamic cache"}
    assert all(row["tokens_per_s"] > 0 for row in decode["rows"].values())
    # Same weights, fp32, greedy: Hugging Face and the plain runner must produce the fast engine's tokens.
    for name in ("HF static cache", "HF dynamic cache", "lmfs plain runner"):
        same, total = decode["rows"][name]["greedy_tokens_equal_lmfs"].split("/")
        assert same == total, (name, decode["rows"][name])
    assert result["trace"]["rows"]["lmfs engine"]["tokens_per_s"] > 0
    assert result["trace"]["rows"]["lmfs plain runner"]["tokens_per_s"] > 0
    assert result["paged_kv"]["kv_in_use_over_cached"] >= 1  # whole blocks hold at least the tokens
    spec_rows = result["speculative"]["rows"].values()
    assert spec_rows and all(0 <= row["acceptance_rate"] <= 1 and row["speedup"] > 0 for row in spec_rows)
    assert set(result["ratios"]) >= {"decode: lmfs / HBM roofline", "decode: lmfs / fastest HF",
                                     "trace: lmfs / best static-batch HF", "paged KV in use / cached bytes",
                                     "decode: plain runner / fast", "trace: plain runner / fast"}


def test_failing_section_becomes_an_error_row(capsys):
    result = {}

    def broken():
        raise RuntimeError("out of memory\nmore detail")

    bench._section(result, "trace", broken)
    assert result["trace"]["error"] == "RuntimeError: out of memory" and result["trace"]["seconds"] >= 0
    rows = {}
    bench._peer(rows, "HF static batch 8", broken)
    assert rows["HF static batch 8"] == {"error": "RuntimeError: out of memory"}


def test_request_trace_is_seeded_and_in_range():
    trace = bench.request_trace(50, (128, 1024), (64, 512), vocab_size=32_000, seed=3)
    assert trace == bench.request_trace(50, (128, 1024), (64, 512), vocab_size=32_000, seed=3)
    assert all(128 <= len(p) <= 1024 and 64 <= o <= 512 for p, o in trace)
    assert all(0 < t < 32_000 for p, _ in trace for t in p)


def test_roofline_bytes_match_a_real_cache():
    # The KV bytes per token the roofline counts are those a cache of the 1B model really holds.
    config = bench.LLAMA_1B
    cache = KVCache(config, batch_size=1, max_len=8, device="meta", dtype=torch.bfloat16)
    assert bench.kv_bytes_per_token(config, torch.bfloat16) * 8 == cache.nbytes == 8 * 32 * 1024
    assert abs(config.num_params() / 1.04e9 - 1) < 0.01


@pytest.mark.gpu
def test_benchmark_runs_on_gpu_tiny(tmp_path):
    # The GPU code paths (bf16, CUDA graphs, the Triton decode kernel, HF's compiled static cache)
    # on the tiny model and trace: every section must report, none with an error.
    pytest.importorskip("transformers")
    path = tmp_path / "inference.json"
    bench.main(["--device", "cuda", "--tiny", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["dtype"] == "bfloat16"
    for section in ("decode_batch1", "trace", "paged_kv", "speculative"):
        assert "error" not in result[section], (section, result[section])
    assert all("error" not in row for row in result["decode_batch1"]["rows"].values()), result["decode_batch1"]


def test_parts_are_chosen_and_saved_as_they_finish(tmp_path, monkeypatch):
    # Only the paged part: the engine runs the trace (no Hugging Face rows), nothing else runs, and
    # the JSON file is written when the part ends, before the summary.
    path = tmp_path / "inference.json"
    saved = []
    real_save = bench.save_json
    monkeypatch.setattr(bench, "save_json", lambda result, p: (saved.append(dict(result)), real_save(result, p)))
    result = bench.main(["--device", "cpu", "--parts", "paged", "--json", str(path)])
    assert "decode_batch1" not in result and "speculative" not in result
    assert set(result["trace"]["rows"]) == {"lmfs engine"}
    assert result["paged_kv"]["kv_in_use_over_cached"] >= 1
    assert "paged KV in use / cached bytes" in saved[0]["ratios"]
    assert json.loads(path.read_text())["parts"] == ["paged"]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--parts", "decode,bogus"])


def test_predicted_speedup_sums_the_accepted_prefixes():
    # E[tokens per target call] = sum over i = 0..k of P(first i drafts accepted) = sum alpha^i.
    for alpha, k, cost in ((0.0, 4, 0.1), (0.6, 2, 0.25), (0.9, 4, 0.05), (1.0, 3, 0.2)):
        expected = sum(alpha ** i for i in range(k + 1)) / (k * cost + 1)
        assert abs(bench.predicted_speedup(alpha, k, cost) - expected) < 1e-12

"""``python -m lmfs.benchmarks evaluation`` runs on the CPU (a tiny model), every scorer gives the
reference's log-probabilities, and a failing peer becomes an error row."""

import json

import pytest
import torch

from lmfs.benchmarks import evaluation as bench
from lmfs.data.corpora import generate_stories
from lmfs.tokenization.hf import hf_tokenizer
from lmfs.train import prepare_tokens

TINY = bench.Sizes(story_bytes=200_000, vocab_size=512, d_model=32, n_layers=1, n_heads=2, context_length=256,
                   items=6, shots=1, batch_size=8, repeats=1)


def test_hf_tokenizer_gives_lmfs_ids():
    pytest.importorskip("transformers")
    tokenizer = prepare_tokens("stories", n_bytes=TINY.story_bytes, vocab_size=TINY.vocab_size).tokenizer
    hf = hf_tokenizer(tokenizer)
    for text in (generate_stories(5_000, seed=7), "x  =  12 + 7\n\n\tdone!", "<|endoftext|>Lily went", "café ☕ 😀"):
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text)
        assert hf.decode(tokenizer.encode(text)) == text


def test_benchmark_runs_on_cpu(tmp_path):
    pytest.importorskip("lm_eval.models.huggingface")  # needs accelerate besides lm-eval
    path = tmp_path / "evaluation.json"
    bench.main(["--device", "cpu", "--items", "6", "--json", str(path)])
    result = json.loads(path.read_text())
    assert set(result["rows"]) == {"lmfs batched", "lmfs one at a time", "lm-eval HF"}
    for name, row in result["rows"].items():
        assert "error" not in row, (name, row)
        assert row["tokens_per_s"] > 0
        assert row["max_abs_diff"] < 1e-3, (name, row)  # nats per pair, float32: the same scores
    assert result["pairs"] == 6 * 4
    assert set(result["ratios"]) == {"lmfs batched / lmfs one at a time", "lmfs batched / lm-eval HF"}


def test_failing_peer_becomes_an_error_row(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise RuntimeError("no backend here\nmore detail")

    monkeypatch.setattr(bench, "lm_eval_scorer", refuse)
    result = bench.run(TINY, "cpu")
    assert result["rows"]["lm-eval HF"] == {"error": "RuntimeError: no backend here"}
    assert result["rows"]["lmfs batched"]["max_abs_diff"] < 1e-4
    assert set(result["ratios"]) == {"lmfs batched / lmfs one at a time"}
    assert "RuntimeError: no backend here" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_benchmark_on_gpu_meets_its_goals():
    # One H200: batched ≥ 5x one at a time and ≥ 1.0x lm-eval's HF backend, same scores (bf16).
    result = bench.run(device="cuda")
    rows = result["rows"]
    assert all("error" not in row for row in rows.values()), rows
    assert all(row["max_abs_diff"] < 0.5 for row in rows.values()), rows  # nats per pair, bf16
    assert result["ratios"]["lmfs batched / lmfs one at a time"] >= 5
    assert result["ratios"]["lmfs batched / lm-eval HF"] >= 1.0

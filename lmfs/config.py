"""Sizes per lecture and scale. Notebooks never hard-code sizes: they ask for their config here.

    cfg = lecture_config("01", ctx.scale)
    cfg.corpus_bytes, cfg.vocab_size

``smoke`` sizes finish a notebook in about a minute on a 2-core CPU; ``full`` sizes give the real
result on one H200 within the two-minute budget (DESIGN.md, "Scales and budgets").
"""

from __future__ import annotations

from types import SimpleNamespace

from lmfs.env import resolve_scale

CONFIGS: dict[str, dict[str, dict]] = {
    "01": {
        "smoke": dict(
            corpus_bytes=300_000,      # text the BPE tokenizer is trained on
            vocab_size=1_000,          # the tokenizer the lecture inspects
            sweep_vocab=4_000,         # compression-vs-vocabulary curve goes up to this size
            sweep_bytes=600_000,
            heldout_bytes=100_000,     # text for compression and out-of-vocabulary measurements
            bench_bytes=2_000_000,     # throughput comparison with Hugging Face and tiktoken
            bench_vocab=2_000,
            stream_lines=20_000,       # lines fed through encode_iterable in the memory demo
        ),
        "full": dict(
            corpus_bytes=5_000_000,    # pydoc (the default CORPUS) holds about 0.47 MB in all
            vocab_size=10_000,
            sweep_vocab=32_000,
            sweep_bytes=20_000_000,
            heldout_bytes=500_000,
            bench_bytes=30_000_000,
            bench_vocab=10_000,
            stream_lines=400_000,
        ),
    },
    "03": {
        "smoke": dict(
            corpus_bytes=1_000_000,    # stories tokenized for the ablations
            vocab_size=512,
            d_model=64,                # the base (LLaMA-like) model every ablation changes one field of
            n_layers=2,
            n_heads=4,
            context_length=64,
            batch_size=16,
            steps=50,                  # per ablation run
            lr=3e-3,                   # base learning rate (SwiGLU/ReLU and position ablations)
            high_lr=1e-2,              # pre/post-norm and QK-norm ablations
            warmup_steps=5,
            eval_every=10,
            eval_batches=4,
            norm_bench_shape=(4096, 1024),  # rows x dim of the LayerNorm/RMSNorm timing
        ),
        "full": dict(
            corpus_bytes=20_000_000,
            vocab_size=1_024,
            d_model=384,
            n_layers=6,
            n_heads=6,
            context_length=256,
            batch_size=64,
            steps=500,
            lr=1e-3,
            high_lr=6e-3,
            warmup_steps=25,
            eval_every=50,
            eval_batches=8,
            norm_bench_shape=(65_536, 4096),
        ),
    },
}


def lecture_config(lecture: str, scale: str = "auto") -> SimpleNamespace:
    """The sizes of ``lecture`` ("01".."17") at ``scale`` ("smoke", "full" or "auto")."""
    lecture = f"{int(lecture):02d}"
    if lecture not in CONFIGS:
        raise KeyError(f"lecture {lecture} has no config yet; known: {', '.join(sorted(CONFIGS))}")
    return SimpleNamespace(**CONFIGS[lecture][resolve_scale(scale)])

"""Sizes of lectures 01-04 (tokenization, PyTorch and accounting, architectures, mixture of experts) at each scale (see :mod:`lmfs.scales`)."""

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
            parallel_bytes=3_000_000,  # parallel pre-tokenization: the training text repeated to this size,
            chunk_bytes=500_000,       # so that counting takes long enough for a second process to pay off
        ),
        "full": dict(
            corpus_bytes=5_000_000,    # pydoc (the default CORPUS) holds about 0.47 MB in all
            vocab_size=10_000,
            sweep_vocab=32_000,
            sweep_bytes=10_000_000,    # the stdlib of a slim Python 3.12 install is ~10.7 MB
            heldout_bytes=500_000,
            bench_bytes=10_000_000,    # `make bench-tokenizer` runs the 30 MB benchmark
            bench_vocab=10_000,
            stream_lines=100_000,
            parallel_bytes=20_000_000,
            chunk_bytes=1_000_000,
        ),
    },
    "02": {
        "smoke": dict(
            warmup=2, reps=5,              # timing: untimed calls first, then the median of `reps`
            matmul_sizes=(64, 128, 256, 512, 1024),  # square matmuls for FLOP/s and the roofline
            elementwise_numel=2**24,       # elements per operand of the memory-bound ops
            # The model whose FLOPs, memory and speed we measure (the chart always uses GPT-2 small).
            model=dict(vocab_size=1024, context_length=64, d_model=64, n_layers=2, n_heads=4,
                       tie_embeddings=False),
            batch_size=8,                  # sequences per step of that model
            step_reps=3,                   # timed training steps per measurement
            # A small model for the exactness checks (gradients, optimizers): the same at every scale.
            check_model=dict(vocab_size=512, context_length=64, d_model=64, n_layers=2, n_heads=4),
            accum_splits=(1, 2, 4, 8),     # micro-batches per step in the accumulation sweep
            init_depth=24, init_width=256,  # the deep linear stack of the initialisation demo
            # The short training run (and the optimizer comparison) on generated stories.
            corpus_bytes=300_000, vocab_size=512,
            train_model=dict(context_length=64, d_model=64, n_layers=2, n_heads=4),
            train_batch=16, train_steps=60, lr=3e-3, warmup_steps=6, eval_every=20, eval_batches=4,
            opt_steps=25,                  # per optimizer in the comparison
        ),
        "full": dict(
            warmup=5, reps=20,
            matmul_sizes=(128, 256, 512, 1024, 2048, 4096, 8192),
            elementwise_numel=2**27,
            # GPT-2 small's shape in lmfs's Llama-style defaults: 134M parameters untied.
            model=dict(vocab_size=32_000, context_length=1024, d_model=768, n_layers=12, n_heads=12,
                       tie_embeddings=False),
            batch_size=8,
            step_reps=10,
            check_model=dict(vocab_size=512, context_length=64, d_model=64, n_layers=2, n_heads=4),
            accum_splits=(1, 2, 4, 8),
            init_depth=48, init_width=1024,
            corpus_bytes=25_000_000, vocab_size=1_024,  # about one epoch of the run below
            train_model=dict(context_length=256, d_model=256, n_layers=4, n_heads=8),
            train_batch=64, train_steps=300, lr=2e-3, warmup_steps=30, eval_every=50, eval_batches=8,
            opt_steps=100,
        ),
    },
    "03": {
        "smoke": dict(
            corpus_bytes=1_000_000,    # text tokenized for the ablations (CORPUS, default "stdlib")
            vocab_size=512,
            d_model=64,                # the base (LLaMA-like) model; each ablation changes one field
            n_layers=4,                # depth is what post-norm handles badly: 2 layers hide it
            n_heads=4,
            context_length=64,
            batch_size=16,
            steps=100,                 # per ablation run: pre < post, QK-norm < none, RoPE < learned (seeds 0, 1)
            lr=1e-2,                   # base learning rate; a 100-step run needs the high one too
            high_lr=1e-2,              # pre/post-norm and QK-norm ablations
            warmup_steps=5,
            eval_every=10,
            eval_batches=4,
            norm_bench_shape=(4096, 1024),  # rows x dim of the LayerNorm/RMSNorm timing
        ),
        "full": dict(
            corpus_bytes=9_000_000,    # below the ~10.7 MB stdlib of a slim Python 3.12: no repeats
            vocab_size=2_048,
            d_model=384,
            n_layers=6,
            n_heads=6,
            context_length=256,
            batch_size=32,
            steps=250,                 # 2 M tokens per run, under one epoch
            lr=1e-3,
            high_lr=3e-3,
            warmup_steps=20,
            eval_every=25,
            eval_batches=8,
            norm_bench_shape=(65_536, 4096),
        ),
    },
    "04": {
        "smoke": dict(
            corpus_bytes=300_000,      # text tokenized for the training runs (CORPUS, default "stdlib")
            vocab_size=512,
            d_model=64,                # the dense base model; the MoE variants replace its feed-forwards
            n_layers=2,
            n_heads=4,
            context_length=64,
            batch_size=16,
            steps=30,                  # per run (the upcycling comparison splits it: half dense, half MoE)
            lr=3e-3,
            warmup_steps=3,
            eval_every=10,
            eval_batches=2,
            n_experts=8,               # routed experts of the MoE variants
            bias_rate=1e-2,            # sigmoid router's bias step (short runs need a larger step)
            capacity_factors=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0),
        ),
        "full": dict(
            corpus_bytes=9_000_000,    # below the ~10.7 MB stdlib of a slim Python 3.12: no repeats
            vocab_size=2_048,
            d_model=256,
            n_layers=4,
            n_heads=4,
            context_length=256,
            batch_size=32,
            steps=600,                 # 4.9 M tokens per run
            lr=2e-3,
            warmup_steps=40,
            eval_every=50,
            eval_batches=8,
            n_experts=8,
            bias_rate=1e-3,            # DeepSeek-V3's step
            capacity_factors=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0),
        ),
    },
}

"""Sizes per lecture and scale. Notebooks never hard-code sizes: they ask for their config here.

    cfg = lecture_config("01", ctx.scale)
    cfg.corpus_bytes, cfg.vocab_size

``smoke`` sizes finish a notebook in about a minute on a 2-core CPU; ``full`` sizes give the real
result on one H200 within a two-minute budget (five minutes for sweep and RL lectures).
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
    "05": {
        "smoke": dict(
            warmup=1, reps=5,              # timing: untimed calls first, then the median of `reps`
            copy_bytes=2**25,              # buffer of the copy-bandwidth probe
            strides=(1, 2, 4, 8, 16, 32),  # strided-read probe: every stride-th float32
            strided_elements=2**18,        # elements actually copied at each stride
            matmul_n=256,                  # square matmul of the matmul-rate probe
            matmul_dtypes=("fp32",),
            roofline_numel=2**20,          # elements per operand of the memory-bound kernels
            roofline_sizes=(32, 64, 128, 256),  # square matmuls placed on the roofline
            sweep=(64, 384, 32),           # matmul-throughput sweep: start, stop, step
            tile=(256, 128),               # (BM, BN) output tile of the wave-quantisation model
            tiled_n=64, tiled_tiles=(4, 8, 16, 32),  # toy tiled matmul that counts its loads
            online_cols=12, online_block=4,  # online softmax, step by step
        ),
        "full": dict(
            warmup=3, reps=20,
            copy_bytes=2**30,              # far beyond the 50 MB L2 of an H100/H200
            strides=(1, 2, 4, 8, 16, 32),
            strided_elements=2**26,
            matmul_n=8192,
            matmul_dtypes=("fp32", "tf32", "bf16", "fp16"),
            roofline_numel=2**27,
            roofline_sizes=(256, 512, 1024, 2048, 4096, 8192),
            sweep=(1536, 6144, 64),        # multiples of 64: aligned, so only tiles and waves change
            tile=(256, 128),
            tiled_n=64, tiled_tiles=(4, 8, 16, 32),
            online_cols=12, online_block=4,
        ),
    },
    "06": {
        "smoke": dict(
            check_shape=(37, 300),         # GeLU/softmax/RMSNorm checks: 300 is no power of two
            attn_check=dict(B=1, H=2),     # FlashAttention checks (fp32 under the interpreter)
            attn_check_head_dims={"float32": 32, "bfloat16": 32},  # head dim per dtype (bf16: GPU only)
            attn_check_lens=(64, 100),     # 100 is not a multiple of the blocks (64 queries, 32 keys)
            torch_fa_block=32,             # block size of the tiled PyTorch FlashAttention
            profile_shape=(64, 256),       # tensor the profiler tables run on
            attn_profile=dict(B=1, H=2, T=64, D=32),
            bench_shape=(64, 256),         # the bandwidth timings (toy size: the interpreter's times mean nothing)
            bench_repeats=(1, 3),          # (warm-up calls, timed calls) of each bandwidth timing
            compile=False,                 # torch.compile costs ~20 s on a CPU: GPU only
            attn_seq_lens=(32, 64), attn_head_dims=(32,), attn_tokens=64, attn_heads=2,
            attn_repeats=(1, 2),           # (warm-up calls, timed calls) of each attention timing
            attn_autotune_candidates=None,  # the interpreter does not autotune
            # the model fuse_model is checked on (fused projections in PyTorch on a CPU)
            fuse_model=dict(vocab_size=128, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2),
            fuse_batch=(2, 32),
        ),
        "full": dict(
            check_shape=(1000, 3000),
            attn_check=dict(B=2, H=4),
            # bf16 checks at the timings' head dim: each (head dim, dtype, causal) compiles every
            # autotuning candidate it is asked to try (about a second each), so checks and timings share them
            attn_check_head_dims={"float32": 32, "bfloat16": 128},
            attn_check_lens=(1000,),       # the timings below also check T = 1024, 4096, 8192
            torch_fa_block=64,
            profile_shape=(8192, 4096),
            attn_profile=dict(B=4, H=16, T=4096, D=128),  # the timings' T = 4096 shape: tuned already
            # 131072 × 4096 bf16 = 1 GiB: a forward + backward keeps the GPU busy for over a
            # millisecond, so the time Python and autograd take to issue it hides behind the kernels
            bench_shape=(131072, 4096),
            bench_repeats=(5, 30),
            compile=True,
            # a few lengths: each new one re-times the candidates (~1 s), the kernels are compiled once
            attn_seq_lens=(1024, 4096, 8192), attn_head_dims=(128,), attn_tokens=16384, attn_heads=16,
            attn_repeats=(3, 10),
            # the first 2 autotuning candidates per kernel (of up to 7; the likeliest winners come
            # first): 12 compiled attention kernels instead of 30 for D = 128, causal and not
            attn_autotune_candidates=2,
            fuse_model=dict(vocab_size=32000, context_length=1024, d_model=768, n_layers=4, n_heads=12),
            fuse_batch=(4, 1024),
        ),
    },
    "07": {
        "smoke": dict(
            collective_ranks=4,            # the collectives table: ranks in the demo
            bench_ranks=2,                 # the bandwidth benchmark (NCCL when there are 2 GPUs)
            bench_sizes=(2**16, 2**18, 2**20, 2**22, 2**24),  # message bytes: 64 KB .. 16 MB, gloo
            bench_warmup=2, bench_iters=10,
            torchrun_max_mb=0.25,          # the same benchmark started by torchrun, up to this size
            copy_bytes=2**26,              # device-memory copy probe for the hierarchy table
        ),
        "full": dict(
            collective_ranks=4,            # 4 ranks > 2 GPUs: these run on gloo even here
            bench_ranks=2,
            bench_sizes=None,              # bandwidth_worker's default: 1 MB .. 1 GB on GPUs, 64 KB .. 16 MB on CPUs
            bench_warmup=5, bench_iters=20,
            torchrun_max_mb=64,
            copy_bytes=2**30,
        ),
    },
    "08": {
        "smoke": dict(
            world_size=2,                  # ranks for every strategy (NCCL on 2 GPUs, else gloo)
            model=dict(n_kv_heads=2),      # overrides of lmfs.parallel.demo_config (~40k parameters)
            steps=3, batch_size=8, seq_len=16,
            adamw=dict(lr=1e-3, eps=1e-6),  # eps bounds how much Adam amplifies rounding noise
            sgd=dict(lr=0.1, momentum=0.9),  # SGD's step is proportional to the gradient
            bucket_size_mb=0.02,           # small buckets, so DDP and ZeRO-2 use several
            micro_batches=4,
            moe=dict(tokens=32, d_model=16, d_ff=32, n_experts=8),
            ring=dict(batch=2, heads=2, seq_len=32, head_dim=8),
            # Sleeps long enough that late wake-ups of a busy CPU (a few ms) stay small against them.
            bubble=dict(stages=4, micro_batches=(1, 2, 4, 8), forward_ms=50, backward_ms=100),
            atol=1e-5,                     # parameters after training vs single-process training
            throughput=None,               # needs 2 GPUs: the full scale runs it
        ),
        "full": dict(
            world_size=2,
            model=dict(n_kv_heads=2),
            steps=3, batch_size=8, seq_len=16,
            adamw=dict(lr=1e-3, eps=1e-6),
            sgd=dict(lr=0.1, momentum=0.9),
            bucket_size_mb=0.02,
            micro_batches=4,
            moe=dict(tokens=32, d_model=16, d_ff=32, n_experts=8),
            ring=dict(batch=2, heads=2, seq_len=32, head_dim=8),
            bubble=dict(stages=4, micro_batches=(1, 2, 4, 8), forward_ms=20, backward_ms=40),
            atol=1e-5,
            # Throughput on 2 GPUs: a ~110M-parameter model, fp32, 16 × 512 tokens per step.
            throughput=dict(model=dict(vocab_size=8192, context_length=512, d_model=1024, n_layers=8,
                                       n_heads=16),
                            batch_size=16, steps=8, micro_batches=4, bucket_size_mb=25),
        ),
    },
    "09": {
        "smoke": dict(
            toy_sizes=(10, 30, 100, 300, 1_000, 3_000), toy_trials=200,  # mean estimation: n, repeats
            bootstrap=50,              # bootstrap refits of the power-law fits
            chinchilla_bootstrap=0,    # refits of the 5-parameter fit to the 240 Figure-4 runs (~1 s each)
            corpus_bytes=300_000,      # text tokenized for the sweep (CORPUS, default "stdlib")
            vocab_size=512,
            context_length=32,
            batch_size=16,
            lr=1e-2,
            eval_batches=4,
            n_heads=2,
            # model sizes (changes to the base config) x FLOP budgets C = 6·N·D
            # 2.9 K .. 86 K parameters. Runs outside min_steps..max_steps are left out, which keeps
            # three sizes per budget centred on its optimum (3e9: d 4-16, 9e9: d 8-32, 2.7e10:
            # d 16-64): each budget's lowest loss falls on its middle size, so the IsoFLOP minima are
            # bracketed (an off-centre grid tilts the parabola), and the long runs of the smallest
            # models at the largest budgets, far below those optima, cost nothing.
            sizes=(dict(d_model=4, n_layers=1), dict(d_model=8, n_layers=1), dict(d_model=16, n_layers=1),
                   dict(d_model=32, n_layers=1), dict(d_model=64, n_layers=1)),
            budgets=(3e9, 9e9, 2.7e10),
            min_steps=40, max_steps=800,
            workers=1,                 # runs trained at once (processes); 1 on a CPU
            # critical batch size: one model, several batch sizes, steps to a target loss
            batch_model=dict(d_model=16, n_layers=1), batch_sizes=(4, 8, 16, 32), batch_steps=80,
            batch_lr=1e-2, noise_small=4, noise_big=32, noise_repeats=4,
        ),
        "full": dict(
            toy_sizes=(10, 30, 100, 300, 1_000, 3_000, 10_000, 30_000), toy_trials=2_000,
            bootstrap=100,
            chinchilla_bootstrap=40,
            corpus_bytes=9_000_000,    # the data of lectures 03 and 04: about 3 M tokens
            vocab_size=2_048,
            context_length=128,
            batch_size=32,
            lr=3e-3,
            eval_batches=16,
            n_heads=4,
            # 0.1 M .. 1.1 M parameters (embeddings included): 0.3 .. 300 tokens per parameter over the
            # budgets, so every budget's optimum lies inside; 15 runs, 24k steps of 4096 tokens
            sizes=(dict(d_model=32, n_layers=2), dict(d_model=48, n_layers=2), dict(d_model=64, n_layers=3),
                   dict(d_model=96, n_layers=3), dict(d_model=128, n_layers=4)),
            budgets=(2e12, 6e12, 1.8e13),
            min_steps=10, max_steps=None,  # every run of the grid is trained
            workers=6,                 # small models leave the GPU idle: six train at once
            batch_model=dict(d_model=64, n_layers=2), batch_sizes=(8, 16, 32, 64, 128, 256), batch_steps=400,
            batch_lr=3e-3, noise_small=8, noise_big=256, noise_repeats=8,
        ),
    },
    "10": {
        "smoke": dict(
            # Timing model (random weights): prefill/decode, batch sweep, KV table, bandwidth.
            timing_model=dict(vocab_size=512, context_length=256, d_model=128, n_layers=2, n_heads=4,
                              n_kv_heads=2),
            mlp_tokens=(1, 4, 16, 64, 256),     # tokens per MLP call in the intensity table
            prefill_tokens=128,                 # prompt length of the prefill measurement
            decode_steps=16,                    # timed decode steps per measurement
            batch_sizes=(1, 2, 4, 8, 16, 32),   # latency/throughput sweep (decode at decode_context)
            decode_context=64,
            warmup=1, reps=3,
            # The trained models: target and draft (speculative decoding), quantisation table.
            corpus_bytes=300_000, vocab_size=512,
            target=dict(context_length=128, d_model=64, n_layers=2, n_heads=4),
            draft=dict(context_length=128, d_model=32, n_layers=1, n_heads=2),
            batch_size=16, train_context=64, target_steps=60, draft_steps=60, lr=3e-3, warmup_steps=5,
            eval_batches=4,
            quant_group=32,                     # group size of int8/int4 (divides d_model)
            spec_k=(2, 4), spec_tokens=48,      # draft lengths tried, tokens generated per run
            chi2_vocab=6, chi2_samples=300,     # distribution test: tiny vocabulary, samples (CPU at any scale)
            # The request trace of the batching comparison.
            trace_requests=24, trace_prompt=(4, 48), trace_output=(4, 48), max_batch_size=8,
        ),
        "full": dict(
            # The benchmark's Llama-shaped ~1B model, random weights, bf16.
            timing_model=dict(vocab_size=32_000, context_length=2048, d_model=2048, n_layers=16, n_heads=32,
                              n_kv_heads=8, d_ff=8192),
            mlp_tokens=(1, 4, 16, 64, 256, 1024, 4096, 16384),
            prefill_tokens=1024,
            decode_steps=16,                    # per timed run: eager steps are slow (~25 ms), their median steady
            batch_sizes=(1, 4, 16, 64, 128, 256),
            decode_context=512,
            warmup=3, reps=10,
            corpus_bytes=4_000_000, vocab_size=1_024,  # ~0.9 M tokens: the target sees each about twice
            # 16 target layers against 1 draft layer: with both captured in CUDA graphs a step's cost
            # follows its kernel count, so the draft costs about 1/8 of the target (c in the lecture)
            target=dict(context_length=512, d_model=512, n_layers=16, n_heads=8),
            draft=dict(context_length=512, d_model=128, n_layers=1, n_heads=2),
            batch_size=32, train_context=256, target_steps=200, draft_steps=300, lr=2e-3, warmup_steps=30,
            eval_batches=4,                     # 33k tokens; formats are compared on the same windows
            quant_group=128,
            spec_k=(2, 4), spec_tokens=128,
            chi2_vocab=6, chi2_samples=300,     # the draft is 3.2 chi2-distance per sample away: a few dozen reject it
            # 2 static batches of 64 (the eager static loop costs ~65 ms a step: its 190 steps dominate)
            trace_requests=128, trace_prompt=(32, 224), trace_output=(16, 96), max_batch_size=64,
        ),
    },
    "11": {
        "smoke": dict(
            corpus_bytes=300_000,      # text tokenized for every run (CORPUS, default "stdlib")
            vocab_size=512,
            n_layers=2,
            n_heads=4,                 # fixed as the width grows, so head_dim grows with it
            context_length=32,
            batch_size=8,
            base_width=32,             # μP's base model: the width hyperparameters are tuned at
            coord_widths=(32, 64, 128, 256),  # coordinate check: widths, Adam steps, seeds, rate
            coord_steps=4,
            coord_seeds=(0, 1),
            coord_lr=1e-2,
            sweep_widths=(32, 64, 128),       # learning-rate sweep: widths x rates, steps per run
            sweep_lrs=(3e-3, 1e-2, 3e-2, 1e-1),
            sweep_steps=30,
            wsd_width=64,              # WSD vs cosine: the model, its rate, the trunk's decay points
            wsd_lr=1e-2,
            wsd_batch_size=16,
            wsd_decay_starts=(20, 40, 60),
            wsd_decay_fraction=0.2,    # each branch decays over this share of its total length
            eval_batches=4,
        ),
        "full": dict(
            corpus_bytes=9_000_000,    # as lectures 03 and 04: the tokenized data is shared
            vocab_size=2_048,
            n_layers=4,
            n_heads=8,
            context_length=128,
            batch_size=32,
            base_width=128,
            coord_widths=(128, 256, 512, 1024),
            coord_steps=10,
            coord_seeds=(0, 1),
            coord_lr=1e-2,
            sweep_widths=(128, 256, 512, 1024),
            sweep_lrs=(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
            sweep_steps=150,           # 0.6 M tokens per run, 24 runs per parametrisation
            wsd_width=256,
            wsd_lr=3e-3,
            wsd_batch_size=32,
            wsd_decay_starts=(150, 300, 600),
            wsd_decay_fraction=0.2,
            eval_batches=8,
        ),
    },
    "12": {
        "smoke": dict(
            story_bytes=400_000,       # generated stories (seed 0) in the training text
            arithmetic_lines=3_000,    # one-digit sums (their own seed) mixed in, eight to a document
            digits=1,                  # operands of the arithmetic tasks: below 10**digits
            vocab_size=512,
            # the model evaluated in the lecture (context long enough for a whole story and its question)
            model=dict(d_model=64, n_layers=2, n_heads=4, context_length=256),
            batch_size=8,
            steps=100,
            lr=3e-3,
            warmup_steps=10,
            n_items=60,                # story-fact and arithmetic multiple-choice items
            shots=(0, 1, 3),           # few-shot prompts compared
            n_gen=30,                  # arithmetic questions answered by sampling
            samples=10,                # samples per question for pass@k
            pass_ks=(1, 2, 5, 10),
            bootstrap=2_000,           # bootstrap resamples
            ci_sizes=(25, 100, 400, 1_600),  # benchmark sizes in the interval-width plot
            # contamination: the trained model continues on story-fact items (with answers)
            # repeated `contam_repeats` times: the test items, or as many fresh ones
            contam_steps=40,
            contam_repeats=8,
            contam_lr=3e-3,
            ngram=8,                   # n of the n-gram overlap check
            min_k=0.2,                 # fraction of lowest token log-probs in min-k% prob
        ),
        "full": dict(
            story_bytes=8_000_000,
            arithmetic_lines=60_000,
            digits=1,
            vocab_size=2_048,
            model=dict(d_model=384, n_layers=6, n_heads=6, context_length=512),
            batch_size=32,
            steps=1_500,               # 25 M tokens, about 3 epochs of the text
            lr=2e-3,
            warmup_steps=100,
            n_items=600,
            shots=(0, 1, 3, 5),
            n_gen=200,
            samples=20,
            pass_ks=(1, 2, 5, 10, 20),
            bootstrap=10_000,
            ci_sizes=(25, 100, 400, 1_600, 6_400),
            contam_steps=150,
            contam_repeats=8,
            contam_lr=1e-3,
            ngram=8,
            min_k=0.2,
        ),
    },
    "13": {
        "smoke": dict(
            crawl_pages=300,           # pages of the crawl: the generated site (full: installed docs if any)
            shard_pages=150,           # pages in each of the two shards of the sharded run
            compare_pages=120,         # pages the three extractors are scored on
            langid_train_per_lang=100,  # generated paragraphs per language to train the classifier
            langid_test_per_lang=40,   # held-out paragraphs per language
            langid_epochs=5,
            langid_buckets=1 << 16,
        ),
        "full": dict(
            crawl_pages=4_000,
            shard_pages=1_000,
            compare_pages=500,
            langid_train_per_lang=400,
            langid_test_per_lang=200,
            langid_epochs=8,
            langid_buckets=1 << 18,
        ),
    },
    "14": {
        "smoke": dict(
            lm_order=3,                # Kneser-Ney n-gram LM of the perplexity filter
            target_bytes=150_000,      # target text T (generated stories) for the LM, classifier, DSIR
            n_buckets=1 << 14,         # hashing trick: buckets of the classifier and DSIR
            clf_dim=8, clf_epochs=4,
            bloom_capacity=20_000,     # keys in the Bloom filter experiment
            bloom_rates=(0.2, 0.1, 0.03, 0.01, 0.003),
            bloom_queries=100_000,
            minhash_docs=600,          # planted near-duplicate corpus (about 2 KB per document)
            scurve=((8, 16), (16, 8), (32, 4)),  # (bands, rows) whose S-curves are measured
            bench_docs=1_000,          # MinHash + LSH throughput vs datasketch
            sample_pages=200,          # pages of the generated site the pipeline runs over
            workers=2,
            # duplicated vs deduplicated training data: stories, a share of them repeated
            train_bytes=300_000, vocab_size=512, dup_share=0.1, dup_times=20,
            model=dict(d_model=64, n_layers=2, n_heads=4, context_length=64),
            batch_size=16, steps=60, lr=3e-3, warmup_steps=6, eval_batches=4,
        ),
        "full": dict(
            lm_order=3,
            target_bytes=1_000_000,    # the filters run in CPU Python/numpy even on the GPU machine
            n_buckets=1 << 16,
            clf_dim=16, clf_epochs=5,
            bloom_capacity=1_000_000,
            bloom_rates=(0.2, 0.1, 0.03, 0.01, 0.003, 0.001),
            bloom_queries=1_000_000,
            minhash_docs=3_000,
            scurve=((8, 16), (16, 8), (32, 4)),
            bench_docs=5_000,
            sample_pages=2_000,
            workers=8,
            train_bytes=6_000_000, vocab_size=2_048, dup_share=0.1, dup_times=20,
            model=dict(d_model=384, n_layers=6, n_heads=6, context_length=256),
            # 400 steps x 8,192 tokens: about 2 passes over the deduplicated text, 0.75 over the duplicated
            batch_size=32, steps=400, lr=2e-3, warmup_steps=30, eval_batches=16,
        ),
    },
    "15": {
        "smoke": dict(
            # The base model (lmfs.alignment.base_model, shared with lectures 16 and 17): text, tokenizer,
            # model and pre-training run. Digits are single tokens; arithmetic is from the train split.
            # At smoke the arithmetic is one-digit sums only, 40% of it in the chat format RL prompts with,
            # and the run takes many small steps: 1,000 x 4 rows (~30 s on one core) get ~80% of the
            # training sums and ~60% of the held-out ones right (greedy); 100 steps of the mixed text got 0%.
            base=dict(story_bytes=20_000, arithmetic_lines=16_000, arithmetic_pool=300, chat_examples=600, seed=0,
                      digit_shares=((1, 1.0),), chat_arithmetic=0.4,
                      vocab_size=512, tokenizer_bytes=300_000,
                      model=dict(d_model=64, n_layers=2, n_heads=4, context_length=256),
                      batch_size=4, steps=1_000, lr=1e-2, warmup_steps=30),
            # SFT of the base model on load_split("instructions", "train") (lmfs.alignment.sft_model); a low
            # learning rate keeps the base model's sums (lr 1e-3 took held-out accuracy at temperature 1 from 34% to 10%)
            sft=dict(steps=20, batch_size=8, micro_batch_size=4, lr=1e-4, warmup_steps=2),
            n_eval=24,                 # held-out problems answered before and after SFT (greedy)
            eval_digits=1,             # ... additions of numbers of this many digits
            n_val_instructions=48,     # held-out instructions for SFT's validation loss
            max_tokens=24,             # reply length limit when generating
            n_show=4,                  # before/after samples printed
            # Reward model (Bradley-Terry) and DPO on the preference pairs; both start from the SFT model
            rm=dict(steps=20, batch_size=8, lr=1e-3, eval_every=10),
            dpo=dict(steps=20, batch_size=8, beta=0.1, lr=1e-4, eval_every=10),
            n_val_pairs=48,            # held-out pairs for the accuracies and margins
        ),
        "full": dict(
            # 14.6 MB of text (stories 8 MB, arithmetic ~4 MB, chat ~3 MB) = 4.9 M tokens, built in ~10 s;
            # 1,600 steps x 32,768 tokens = 52 M tokens (~10 passes): 26-52 s at 1-2 M tokens/s on one H200.
            # arithmetic_pool: distinct sums per size and op the text repeats (of ~6,500 two-digit train
            # additions): the knob that sets how many unseen sums the SFT model gets right (aim: 20-50%)
            base=dict(story_bytes=8_000_000, arithmetic_lines=150_000, arithmetic_pool=1_000, chat_examples=12_000,
                      seed=0, vocab_size=2_048, tokenizer_bytes=3_000_000,
                      model=dict(d_model=384, n_layers=6, n_heads=6, context_length=256),
                      batch_size=128, steps=1_600, lr=2e-3, warmup_steps=100),
            # the 2,000 instructions pack into 475 rows: 60 steps x 32 rows is about 4 passes (~3 s)
            sft=dict(steps=60, batch_size=32, micro_batch_size=16, lr=3e-4, warmup_steps=6),
            n_eval=150,                # all 150 held-out two-digit additions
            eval_digits=2,
            n_val_instructions=300,
            max_tokens=48,
            n_show=6,
            rm=dict(steps=300, batch_size=32, lr=1e-4, eval_every=30),      # 8 passes over the 1,200 pairs
            dpo=dict(steps=300, batch_size=32, beta=0.1, lr=2e-5, eval_every=30),
            n_val_pairs=300,
        ),
    },
    "16": {
        "smoke": dict(
            # The variance of policy-gradient estimates on a softmax bandit: `estimates` independent
            # estimates, each from `bandit_samples` sampled answers (one group).
            bandit_actions=8, bandit_samples=8, estimates=4_000, reward_shift=10.0,
            # The GRPO loop on arithmetic from lmfs.alignment.sft_model (lecture 15's sizes): problems
            # with operands of these digits, train split for RL, held-out test split for evaluation.
            digits=(1,), group_size=8, prompts_per_step=8, max_new_tokens=16, steps=80, epochs=2,
            lr=1e-4, clip=0.2, aggregation="sequence_mean", n_eval=24, temperature=0.7,
            # The length-bias simulation (a policy that only chooses how long to go on after its answer)
            length_steps=60, length_prompts=16, length_max=32, length_accuracy=0.3, length_lr=0.5,
        ),
        "full": dict(
            bandit_actions=8, bandit_samples=8, estimates=20_000, reward_shift=10.0,
            # ~11 M parameters; 32 prompts x 8 answers = 256 rollouts per step, ~1 s per step on one
            # H200 (two passes over each batch); the test split holds 300 two-digit problems
            digits=(2,), group_size=8, prompts_per_step=32, max_new_tokens=32, steps=100, epochs=2,
            lr=1e-4, clip=0.2, aggregation="sequence_mean", n_eval=300, temperature=1.0,
            length_steps=150, length_prompts=32, length_max=48, length_accuracy=0.3, length_lr=0.5,
        ),
    },
    "17": {
        "smoke": dict(
            # GRPO from lmfs.alignment.sft_model (lecture 15's sizes); problems of these difficulties
            # (digits) from load_split("arithmetic", "train"), evaluated on the held-out test split
            train_digits=(1,), eval_digits=(1,), harder_digits=(2,), eval_problems=24,
            grpo=dict(group_size=8, prompts_per_step=8, max_new_tokens=16, lr=1e-4, micro_batch_size=64,
                      epochs_per_batch=2, kl_coef=0.05, clip=0.2, temperature=0.7),
            steps=80,                       # the run on the true checker (~0.2 s a step on one core)
            # reward hacking (section 9): two runs from the SFT model on the harder problems, one on the
            # loose checker, one on the strict one; overrides of `grpo` (no KL leash, one epoch)
            hack=dict(prompts_per_step=4, max_new_tokens=24, lr=1e-3, temperature=1.2, kl_coef=0.0,
                      epochs_per_batch=1),
            hack_steps=3,
            eval_samples=8, k=(1, 8),       # answers per held-out problem, and the k of pass@k
        ),
        "full": dict(
            # ~11 M parameters; 64 prompts x 8 answers = 512 rollouts per step, ~0.5 s per step on one
            # H200; pass@1 is sampled at temperature 1, the training temperature
            train_digits=(2, 3), eval_digits=(2,), harder_digits=(3,), eval_problems=300,
            grpo=dict(group_size=8, prompts_per_step=64, max_new_tokens=32, lr=1e-4, micro_batch_size=128,
                      epochs_per_batch=2, kl_coef=0.02, clip=0.2),
            steps=150,
            # the hacking runs: 3-digit problems (the SFT model is mostly wrong), no KL leash, one
            # epoch, 32 x 8 rollouts per step. A higher learning rate (3e-4) and temperature (1.2)
            # wrecked both runs on the H200: the policies wrote strings of numbers, right in neither
            hack=dict(prompts_per_step=32, max_new_tokens=48, kl_coef=0.0, epochs_per_batch=1),
            hack_steps=100,
            eval_samples=8, k=(1, 8),
        ),
    },
}


def lecture_config(lecture: str, scale: str = "auto") -> SimpleNamespace:
    """The sizes of ``lecture`` ("01".."17") at ``scale`` ("smoke", "full" or "auto")."""
    lecture = f"{int(lecture):02d}"
    if lecture not in CONFIGS:
        raise KeyError(f"lecture {lecture} has no config yet; known: {', '.join(sorted(CONFIGS))}")
    return SimpleNamespace(**CONFIGS[lecture][resolve_scale(scale)])

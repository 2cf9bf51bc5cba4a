"""Sizes of lectures 05-08 and 10 (GPUs, kernels, parallelism, inference) at each scale (see :mod:`lmfs.scales`)."""

CONFIGS: dict[str, dict[str, dict]] = {
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
            attn_naive_max_scores=2**30,  # largest score matrix (elements) the written-out attention is timed at
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
            # 65536 × 4096 bf16 = 512 MiB: a forward + backward still keeps the GPU busy for about a
            # millisecond, so the time Python and autograd take to issue it hides behind the kernels.
            # Twice that (1 GiB, with the written-out versions' saved intermediates) went past a
            # 22 GiB cap (lmfs.env.apply_memory_cap), i.e. would not fit a 24 GB card.
            bench_shape=(65536, 4096),
            bench_repeats=(5, 30),
            compile=True,
            # a few lengths: each new one re-times the candidates (~1 s), the kernels are compiled once
            attn_seq_lens=(1024, 4096, 8192), attn_head_dims=(128,), attn_tokens=16384, attn_heads=16,
            # 2**30 scores: ~8 GiB for the written-out forward; T = 8192 (2**31) went past a 22 GiB cap
            attn_naive_max_scores=2**30,
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
}

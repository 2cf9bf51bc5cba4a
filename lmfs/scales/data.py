"""Sizes of lectures 12-14 (evaluation, data filtering, deduplication) at each scale (see :mod:`lmfs.scales`)."""

CONFIGS: dict[str, dict[str, dict]] = {
    "12": {
        "smoke": dict(
            story_bytes=200_000,       # generated stories (seed 0) in the training text
            arithmetic_lines=8_000,    # one-digit sums (their own seed) mixed in, eight to a document
            digits=1,                  # operands of the arithmetic tasks: below 10**digits
            vocab_size=512,
            # the model evaluated in the lecture (context long enough for a whole story and its question)
            model=dict(d_model=64, n_layers=2, n_heads=4, context_length=256),
            # Many small steps on text that is half sums: the 200 one-digit problems are each seen about
            # 40 times, enough for this model to learn most of them (multiple choice well above chance).
            batch_size=4,
            steps=600,
            lr=1e-2,
            warmup_steps=30,
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
            crawl_pages=300,           # pages of the crawl: installed Debian docs if any, else the generated site
            shard_pages=150,           # pages in each of the two shards of the sharded run
            compare_pages=120,         # pages the three extractors are scored on
            langid_train_per_lang=100,  # generated paragraphs per language to train the classifier (half the phrases)
            langid_test_per_lang=40,   # held-out paragraphs per language
            langid_hard_per_lang=30,   # texts per language in each hard category (short, mixed, code, ...)
            langid_epochs=5,
            langid_buckets=1 << 16,
        ),
        "full": dict(
            crawl_pages=4_000,
            shard_pages=1_000,
            compare_pages=500,
            langid_train_per_lang=400,
            langid_test_per_lang=200,
            langid_hard_per_lang=100,
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
            sample_pages=200,          # pages the pipeline runs over: installed Debian docs if any, else the generated site
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
}

"""Sizes of lectures 09 and 11 (scaling laws, μP) at each scale (see :mod:`lmfs.scales`)."""

CONFIGS: dict[str, dict[str, dict]] = {
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
}

"""Sizes of lectures 15-17 (SFT and DPO, GRPO) at each scale (see :mod:`lmfs.scales`)."""

CONFIGS: dict[str, dict[str, dict]] = {
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
            # This model is fragile: one step of norm 0.1 along the exact policy gradient takes its reward
            # from 0.44 to 0.2, so the learning rate stays at 1e-4 (3e-4 and up lowered the reward), and
            # what buys a clear rise is less noise: 16 prompts a step (8 left the rise within the noise)
            # and temperature 0.5 (at 0.7 the reward rose in some seeds only). 120 steps: a reward rise of
            # 0.09-0.12 between the first and the last quarter of the steps in four seeds, 5 to 8 standard
            # errors (100 steps: 3.4 to 6); held-out pass@1 from 0.25 to 0.42-0.53.
            grpo=dict(group_size=8, prompts_per_step=16, max_new_tokens=16, lr=1e-4, micro_batch_size=64,
                      epochs_per_batch=2, kl_coef=0.05, clip=0.2, temperature=0.5),
            steps=120,                      # the run on the true checker (~0.35 s a step on one core)
            # reward hacking (section 9): two runs from the SFT model, one on the loose checker, one on
            # the strict one; overrides of `grpo` (no KL leash, one epoch). At smoke they only show that
            # the loophole pays the model's own wrong answers (one-digit problems: it gets no two-digit
            # one right, not even in its working); the drift towards it does not show at this size. Four
            # loose runs of 30 steps at lr 2e-4 or 3e-4 (4 epochs, 8 x 8 rollouts, ~10 s each): the loose
            # reward fell in three, and so did the strict runs' accuracy: the model broke rather than
            # learned the loophole; 40 steps of 16 x 8 at lr 1e-4 (~15 s a run) moved it by noise only
            hack_digits=(1,),
            hack=dict(prompts_per_step=8, max_new_tokens=24, temperature=0.7, kl_coef=0.0, epochs_per_batch=1),
            hack_steps=6,
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
            hack_digits=(3,),
            hack=dict(prompts_per_step=32, max_new_tokens=48, kl_coef=0.0, epochs_per_batch=1),
            hack_steps=100,
            eval_samples=8, k=(1, 8),
        ),
    },
}

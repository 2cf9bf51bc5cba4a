"""lmfs.alignment.grpo: the GRPO trainer's mechanics on a tiny random model (CPU, seconds)."""

import copy
import json
import math

import pytest
import torch

from lmfs.alignment.grpo import GRPOConfig, GRPOTrainer, batch_tensors
from lmfs.alignment.pg import aggregate, kl_estimate, pg_loss
from lmfs.alignment import sft
from lmfs.alignment.sft import SPECIAL_TOKENS, response_logprobs
from lmfs.alignment.tasks import Problem, arithmetic_problems
from lmfs.eval import pass_at_k
from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.optim import SGD
from lmfs.tokenization import Tokenizer

CONTEXT = 64


def tiny(seed=0):
    """A byte-level tokenizer with the chat template's special tokens, and a tiny random model."""
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], list(SPECIAL_TOKENS))
    torch.manual_seed(seed)
    model = TransformerLM(TransformerConfig(vocab_size=tok.vocab_size, context_length=CONTEXT, d_model=32,
                                            n_layers=1, n_heads=2))
    return model, tok


def short_problems(n=8):
    # "What is 3 + 4?" in the chat template is about 40 bytes: room for 16 new tokens in 64
    return arithmetic_problems(n, digits=1, seed=1)


def parity(problem, response):
    """A reward a random model can earn: whether its response has an odd number of characters."""
    return float(len(response) % 2)


def trainer(model, tok, problems=None, reward_fn=parity, **config):
    config = dict(dict(group_size=4, prompts_per_step=2, max_new_tokens=8, lr=1e-3, micro_batch_size=8,
                       progress=False), **config)
    return GRPOTrainer(model, tok, problems or short_problems(), reward_fn=reward_fn, config=GRPOConfig(**config))


def test_batch_tensors_masks_only_response_predictions():
    ids, mask = batch_tensors([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    assert ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]]
    # position t predicts token t+1: response tokens sit at 3,4 (row 0) and 1,2,3 (row 1)
    assert mask.int().tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    ids, mask = batch_tensors([[1, 2]], [[]])          # an empty response: nothing scored
    assert not mask.any()


def test_config_refuses_bad_values_with_reasons():
    with pytest.raises(ValueError, match="group of one has no baseline"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="(?s)temperature=0.*loss='ppo'"):
        GRPOConfig(loss="ppo", temperature=0)
    assert GRPOConfig(group_size=4, prompts_per_step=3).batch_size == 12


def test_rollout_logprobs_match_the_training_forward_after_updates():
    """The engine generates from the policy's current weights: after an update (in place), the
    log-probs it reports for its samples equal a fresh forward pass of the updated policy."""
    model, tok = tiny()
    tr = trainer(model, tok, lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    tr.train(2)
    assert any((before[k] - v).abs().max() > 0 for k, v in model.state_dict().items())
    rollout = tr.score(tr.rollout(tr.sample_problems(5)))
    batches = tr.micro_batches(rollout)
    (logp,) = tr.logprobs_of(model, batches)
    (rows, _, mask), = batches
    for i, row in enumerate(rows):
        assert torch.allclose(logp[i][mask[i]], torch.tensor(rollout.sampler_logprobs[row]), atol=1e-4)


def test_bf16_rollouts_give_the_log_probs_of_the_bf16_update():
    """With autocast (bf16 here on the CPU; "auto" picks it on CUDA) the engine computes as the update
    does: its log-probs equal the training forward's under the same autocast, to bf16 precision, and
    differ from the float32 forward's; the weights stay float32."""
    model, tok = tiny()
    tr = trainer(model, tok, lr=1e-2, autocast="bf16")
    assert tr.autocast == torch.bfloat16 and tr.llm.autocast == torch.bfloat16
    tr.train(1)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    rollout = tr.score(tr.rollout(tr.sample_problems(5)))
    batches = tr.micro_batches(rollout)
    (logp,) = tr.logprobs_of(model, batches)
    (rows, ids, mask), = batches
    with torch.no_grad():
        fp32, _ = response_logprobs(model, ids, mask)
    sampled = [torch.tensor(rollout.sampler_logprobs[row]) for row in rows]
    assert max((logp[i][mask[i]] - s).abs().max().item() for i, s in enumerate(sampled)) < 1e-2
    assert max((fp32[i][mask[i]] - s).abs().max().item() for i, s in enumerate(sampled)) > 1e-4
    with pytest.raises(ValueError, match="autocast"):
        GRPOConfig(autocast="fp8")


def test_fused_update_keeps_parameters_and_trains_as_the_plain_modules():
    """fused_update swaps the policy's attention and MLP classes for lmfs.kernels.fused's (same
    parameters, same state dict keys) and trains to the same weights as the plain modules; it
    composes with the engine's fused decode forward (Triton's interpreter here), which under bf16
    autocast holds bf16 copies of the float32 projection weights: every rollout after an optimizer
    step copies them again, and the engine samples what a fresh one on the updated policy samples."""
    from lmfs.kernels.fused import FusedAttention, FusedGatedMLP

    runs = {}
    for fused in (False, True):
        model, tok = tiny()
        keys = list(model.state_dict())
        torch.manual_seed(5)
        tr = trainer(model, tok, lr=1e-2, fused_update=fused)
        assert isinstance(model.blocks[0].attn, FusedAttention) == fused
        assert isinstance(model.blocks[0].mlp, FusedGatedMLP) == fused
        assert list(model.state_dict()) == keys
        tr.train(2)
        runs[fused] = (tr.history.reward, model.state_dict())
    assert runs[True][0] == runs[False][0]
    for name, a in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], a, atol=1e-5, rtol=0, msg=name)
    pytest.importorskip("lmfs.kernels.decode")
    from lmfs.inference import LLM, SamplingParams
    model, tok = tiny()
    tr = trainer(model, tok, lr=1e-2, autocast="bf16")
    where = [p.data_ptr() for p in model.parameters()]
    tr.llm = LLM(model, tok, fused_decode=True, autocast=torch.bfloat16, progress=False)   # bf16 copies
    assert tr.llm._fused.dtype == torch.bfloat16 and [p.data_ptr() for p in model.parameters()] == where
    copies, per_step = tr.llm._fused.weight_copies, 7 * model.config.n_layers   # q, k, v, o, gate, up, down
    tr.train(2)
    assert tr.llm.stats["fused_decode"] and all(math.isfinite(x) for x in tr.history.loss)
    rollout = tr.rollout(tr.sample_problems(5))
    # the first rollout found the weights as built; the second and this one each took in one update
    assert tr.llm._fused.weight_copies == copies + 2 * per_step
    batches = tr.micro_batches(rollout)
    for (rows, _, mask), logp in zip(batches, tr.logprobs_of(model, batches)):
        for i, row in enumerate(rows):
            assert (logp[i][mask[i]] - torch.tensor(rollout.sampler_logprobs[row])).abs().max() < 1e-2
    prompts, params = tr.prompts[:3], SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=True)
    fresh = LLM(model, tok, fused_decode=True, autocast=torch.bfloat16, progress=False).generate(prompts, params)
    assert ([(o.token_ids, o.logprobs) for o in tr.llm.generate(prompts, params)]
            == [(o.token_ids, o.logprobs) for o in fresh])


def test_packed_update_trains_as_the_padded_one(monkeypatch):
    """packed_update computes the update's forward (and the reference's) on the sequences packed into
    one row (no padding): the same rewards, KL, losses and weights as the padded update, over several
    micro-batches and epochs."""
    import lmfs.alignment.grpo as grpo

    calls = []
    monkeypatch.setattr(grpo, "packed_response_logprobs",
                        lambda model, *args: calls.append(model) or sft.packed_response_logprobs(model, *args))
    runs = {}
    for packed in (False, True):
        model, tok = tiny()
        torch.manual_seed(5)
        tr = trainer(model, tok, lr=1e-2, packed_update=packed, micro_batch_size=3, epochs_per_batch=2, kl_coef=0.1)
        tr.train(2)
        runs[packed] = (tr.history, model.state_dict())
    # per step: 3 micro-batches for the reference, 3 per epoch for the policy
    assert sum(m is tr.reference for m in calls) == 2 * 3 and sum(m is model for m in calls) == 2 * 2 * 3
    assert runs[True][0].reward == runs[False][0].reward
    assert runs[True][0].kl == pytest.approx(runs[False][0].kl, abs=1e-6)
    assert runs[True][0].loss == pytest.approx(runs[False][0].loss, abs=1e-5)
    for name, a in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], a, atol=1e-5, rtol=0, msg=name)
    with pytest.raises(ValueError, match="packed_update=True needs fused_update=True"):
        GRPOConfig(packed_update=True, fused_update=False)


def compiled_and_eager_runs(device="cpu", steps=2):
    runs = {}
    for compiled in (False, True):
        model, tok = tiny()
        torch.manual_seed(5)
        tr = trainer(model.to(device), tok, lr=1e-2, compile_update=compiled, micro_batch_size=3)
        tr.train(steps)
        runs[compiled] = tr
    return runs


def test_compiled_update_trains_as_the_eager_one():
    """compile_update runs the update's forward, log-probs and entropy through torch.compile (dynamic
    shapes: micro-batches of 3 and 2 sequences, lengths changing between steps): the same rewards,
    losses and weights as the eager update."""
    runs = compiled_and_eager_runs()
    eager, compiled = runs[False], runs[True]
    assert hasattr(compiled._update_logprobs, "_torchdynamo_orig_callable")
    assert not hasattr(eager._update_logprobs, "_torchdynamo_orig_callable")
    assert compiled.history.reward == eager.history.reward
    assert compiled.history.loss == pytest.approx(eager.history.loss, rel=1e-4, abs=1e-6)
    for (name, a), b in zip(eager.policy.named_parameters(), compiled.policy.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
    with pytest.raises(ValueError, match="packed_update=True and compile_update=True"):
        GRPOConfig(packed_update=True, compile_update=True)


def test_a_failed_compilation_warns_and_the_update_runs_without_it():
    """If torch.compile fails in the first update (an Inductor error, say), the trainer warns with
    the reason and trains on without it: the same step as an eager trainer's."""
    import torch._dynamo

    eager = trainer(*tiny(), lr=1e-2)
    failing = trainer(*tiny(), lr=1e-2, compile_update=True)
    calls = []

    class CompileError(torch._dynamo.exc.BackendCompilerFailed):   # (its constructor varies between versions)
        def __init__(self, message):
            RuntimeError.__init__(self, message)

    def broken(*args):
        calls.append(1)
        raise CompileError("no kernel for this shape")

    failing._update_logprobs = broken
    torch.manual_seed(2)
    h0 = eager.train(1)
    torch.manual_seed(2)
    with pytest.warns(RuntimeWarning, match="compile_update: torch.compile failed .*no kernel for this shape"):
        h1 = failing.train(1)
    assert calls == [1] and failing._update_logprobs is response_logprobs
    assert h1.reward == h0.reward and h1.loss == pytest.approx(h0.loss, rel=1e-5, abs=1e-7)
    for (name, a), b in zip(eager.policy.named_parameters(), failing.policy.parameters()):
        torch.testing.assert_close(b, a, msg=name)


def test_fused_adamw_updates_reach_the_engines_16_bit_weights():
    """Torch's fused AdamW (the trainer's optimizer with fused_update on CUDA; its CPU kernel here)
    writes the parameters without bumping their version counters, which the engine's 16-bit decode
    weights follow: the trainer bumps them after each step, so the rollouts sample from the updated
    policy (their log-probs equal a fresh engine's on the same weights)."""
    pytest.importorskip("lmfs.kernels.decode")
    from lmfs.inference import LLM, SamplingParams

    model, tok = tiny()
    tr = trainer(model, tok, lr=1e-2, autocast="bf16")
    tr.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=tr.config.betas, fused=True)
    tr._torch_optimizer = True
    tr.llm = LLM(model, tok, fused_decode=True, autocast=torch.bfloat16, progress=False)
    param = model.blocks[0].attn.q_proj.weight
    version = param._version
    tr.train(2)
    assert param._version > version
    copies = tr.llm._fused.weight_copies
    tr.rollout(tr.sample_problems(5))
    assert tr.llm._fused.weight_copies > copies          # the second update reached the copies
    prompts, params = tr.prompts[:3], SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=True)
    fresh = LLM(model, tok, fused_decode=True, autocast=torch.bfloat16, progress=False).generate(prompts, params)
    assert ([(o.token_ids, o.logprobs) for o in tr.llm.generate(prompts, params)]
            == [(o.token_ids, o.logprobs) for o in fresh])
    # Without the bump the counters stay put and the engine would keep sampling from stale copies.
    version = param._version
    param.grad = torch.ones_like(param)
    tr.optimizer.step()
    assert param._version == version


def test_micro_batches_sort_by_length_and_cover_every_sequence_once():
    model, tok = tiny()
    tr = trainer(model, tok, micro_batch_size=3)
    rollout = tr.score(tr.rollout(tr.sample_problems(0)))
    rollout.response_ids = [r[:i] for i, r in enumerate(rollout.response_ids)]     # lengths 0..7
    batches = tr.micro_batches(rollout)
    assert sorted(i for rows, _, _ in batches for i in rows) == list(range(8))
    lengths = [len(rollout.prompt_ids[i]) + len(rollout.response_ids[i]) for rows, _, _ in batches for i in rows]
    assert lengths == sorted(lengths, reverse=True)
    for rows, ids, mask in batches:                   # each padded to its own longest sequence only
        want_ids, want_mask = batch_tensors([rollout.prompt_ids[i] for i in rows],
                                            [rollout.response_ids[i] for i in rows])
        assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)


def test_rollout_leaves_only_the_last_texts_for_score():
    """With texts=False the answers that finish while a decode step is still in flight get their text
    at once; those handed over when none is (the last ones) keep None, and score decodes what
    response_text gives."""
    model, tok = tiny()
    tr = trainer(model, tok, max_new_tokens=12)
    tr.stop_ids = tuple(range(0, tok.vocab_size, 10))     # a tenth of the vocabulary ends an answer
    torch.manual_seed(3)
    rollout = tr.rollout(tr.sample_problems(0), texts=False)
    lengths = [len(r) for r in rollout.response_ids]
    assert None in rollout.texts and len(set(lengths)) > 1          # answers finished at several steps
    longest = max(lengths)
    assert [text is None for text in rollout.texts] == [n == longest for n in lengths]
    assert all(text == tr.response_text(ids) for text, ids in zip(rollout.texts, rollout.response_ids) if text)
    tr.score(rollout)
    assert rollout.texts == [tr.response_text(ids) for ids in rollout.response_ids]


def test_training_step_scoring_inside_the_update_equals_scoring_first():
    """train_step builds the batches, queues the update's first forward and only then scores; the
    same step by hand (rollout with every text, score, batches, update) gives the same record,
    texts and weights."""
    model, tok = tiny()
    ours, by_hand = trainer(copy.deepcopy(model), tok), trainer(copy.deepcopy(model), tok)
    torch.manual_seed(2)
    record = ours.train_step()
    torch.manual_seed(2)
    rollout = by_hand.score(by_hand.rollout(by_hand.sample_problems(0)))
    stats = by_hand.update(rollout, by_hand.micro_batches(rollout))
    assert stats["score_seconds"] == 0 and "score_seconds" not in record
    assert record["reward"] == pytest.approx(rollout.rewards.mean().item()) and record["reward"] > 0
    assert record["loss"] == pytest.approx(stats["loss"], rel=1e-6, abs=1e-9)
    assert ours.last_rollout.texts == rollout.texts
    for (name, a), b in zip(ours.policy.named_parameters(), by_hand.policy.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    assert record["reward_s"] > 0 and record["update_s"] > 0


def fused_adamw(tr):
    """Give a CPU trainer the optimizer path of a GPU one: torch's fused AdamW, stepped without
    waiting for the loss (a step from a non-finite loss is skipped through found_inf)."""
    c = tr.config
    tr.optimizer = torch.optim.AdamW(tr.policy.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay,
                                     fused=True)
    tr._torch_optimizer = True
    return tr


def run_steps(overlap, steps=3, torch_adamw=False, device="cpu", **config):
    from lmfs.benchmarks.grpo import RolloutRecorder

    model, tok = tiny()
    tr = trainer(model.to(device), tok, lr=1e-2, overlap_steps=overlap, **config)
    if torch_adamw:
        fused_adamw(tr)
    recorder = RolloutRecorder(tr)
    torch.manual_seed(4)
    history = tr.train(steps)
    recorder.close()
    return tr, history, recorder.early


@pytest.mark.parametrize("torch_adamw", [False, True])
def test_overlapped_steps_train_as_steps_one_after_another(torch_adamw):
    """With overlap_steps each step starts the next one's rollout during its update (after the
    optimizer step is queued): the same rollouts, losses and weights as without, nothing left
    started at the end, and a second train() call goes on from there."""
    (plain, h0, early0), (overlapped, h1, early1) = (run_steps(o, torch_adamw=torch_adamw) for o in (False, True))
    assert (early0, early1) == (0, 2)
    assert h1.reward == h0.reward and h1.response_length == h0.response_length
    assert h1.loss == pytest.approx(h0.loss, rel=1e-5, abs=1e-7)
    for (name, a), b in zip(plain.policy.named_parameters(), overlapped.policy.parameters()):
        torch.testing.assert_close(b, a, msg=name)
    assert overlapped._next_rollout is None and overlapped.llm.allocator.num_used == 0
    assert len(overlapped.train(5).reward) == 5


def test_a_non_finite_loss_leaves_the_weights_and_frees_the_started_rollout(monkeypatch):
    """Stepped without waiting for the loss, a non-finite loss is skipped on the device, the step
    raises, and the rollout it had started for the next step is closed."""
    from lmfs.alignment import grpo
    from lmfs.benchmarks.grpo import RolloutRecorder

    model, tok = tiny()
    tr = fused_adamw(trainer(model, tok))
    recorder = RolloutRecorder(tr)
    before = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(grpo, "aggregate", lambda per_token, mask, **kw: per_token.sum() * float("nan"))
    with pytest.raises(FloatingPointError, match="diverged"):
        tr.train(3)
    assert recorder.early == 1
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)
    assert tr._next_rollout is None and tr.llm.allocator.num_used == 0
    assert sorted(tr.llm.free_rows) == list(range(tr.llm.max_batch_size))


@pytest.mark.parametrize("epochs", [1, 3])
def test_old_logprobs_from_the_first_epoch_equal_a_separate_forward(epochs):
    """The trainer runs no forward pass for the old log-probs: it takes them, detached, from its first
    epoch. By hand: the old log-probs from a separate forward before any update, then ``epochs``
    plain gradient steps on the clipped loss over the whole batch at once. Loss and weights agree."""
    model, tok = tiny()
    lr = 2.0
    tr = trainer(copy.deepcopy(model), tok, epochs_per_batch=epochs, grad_clip=None, micro_batch_size=3)
    tr.optimizer = SGD(tr.policy.parameters(), lr=lr)
    torch.manual_seed(1)
    rollout = tr.score(tr.rollout(tr.sample_problems(0)))
    rollout.advantages = torch.linspace(-1, 1, 8)              # some signal whatever the rewards
    stats = tr.update(rollout, tr.micro_batches(rollout))

    by_hand = copy.deepcopy(model)
    ids, mask = batch_tensors(rollout.prompt_ids, rollout.response_ids)
    with torch.no_grad():
        old, _ = response_logprobs(by_hand, ids, mask)          # the separate old-log-prob forward
    for _ in range(epochs):
        logp, _ = response_logprobs(by_hand, ids, mask)
        loss = aggregate(pg_loss(logp, rollout.advantages, "grpo_clip", old_logp=old, clip=0.2), mask, "sequence_mean")
        by_hand.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in by_hand.parameters():
                p -= lr * p.grad
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    for (name, a), b in zip(tr.policy.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    if epochs == 1:
        assert stats["clip_fraction"] == 0                    # the ratio is exactly 1
    else:
        assert stats["clip_fraction"] > 0                     # later epochs moved far enough to clip


def test_training_raises_a_learnable_reward():
    """The sign of the whole loop: a reward for digits in the response (about 4% of a random model's
    characters) must rise within a dozen steps."""
    model, tok = tiny()

    def digits(problem, response):
        return sum(c.isdigit() for c in response) / max(len(response), 1)
    tr = trainer(model, tok, reward_fn=digits, lr=1e-2, prompts_per_step=4, group_size=8, micro_batch_size=32)
    reward = tr.train(12).reward
    assert sum(reward[-3:]) > 2 * sum(reward[:3])


def test_accumulated_gradient_equals_one_pass_for_every_aggregation():
    model, tok = tiny()
    for how in ("sequence_mean", "token_mean", "constant"):
        deltas = []
        for micro in (8, 3):
            m = copy.deepcopy(model)
            tr = trainer(m, tok, micro_batch_size=micro, aggregation=how, grad_clip=None, loss="baseline")
            tr.optimizer = SGD(m.parameters(), lr=1.0)          # the update is then minus the gradient
            torch.manual_seed(1)
            rollout = tr.score(tr.rollout(tr.sample_problems(0)))
            rollout.advantages = torch.linspace(-1, 1, 8)       # some signal whatever the rewards
            rollout.response_ids[2] = []                        # one empty response: no contribution
            tr.update(rollout, tr.micro_batches(rollout))
            deltas.append(torch.cat([(p - q).flatten() for p, q in zip(m.parameters(), model.parameters())]))
        assert deltas[0].abs().max() > 0
        torch.testing.assert_close(deltas[1], deltas[0], atol=1e-6, rtol=1e-4, msg=how)


def test_equal_rewards_and_empty_responses_give_zero_finite_losses():
    model, tok = tiny()
    tr = GRPOTrainer(model, tok, short_problems(), reward_fn=lambda p, r: 1.0,
                     config=GRPOConfig(group_size=4, prompts_per_step=2, max_new_tokens=8, progress=False))
    before = copy.deepcopy(model.state_dict())
    history = tr.train(1)
    assert history.loss == [0.0] and history.informative_groups == [0.0] and history.reward == [1.0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # nothing to learn
    rollout = tr.score(tr.rollout([0, 1]))
    rollout.response_ids = [[] for _ in rollout.response_ids]                       # every response empty
    stats = tr.update(rollout, tr.micro_batches(rollout))
    assert stats["loss"] == 0.0 and not any(math.isnan(v) for k, v in stats.items() if k != "kl")


def test_prompts_longer_than_the_context_are_left_out_or_refused():
    model, tok = tiny()
    long = Problem("What is " + " + ".join(["1"] * 40) + "?", "40", "arithmetic", 1, {})
    with pytest.warns(UserWarning, match="1 of 9 prompts.*left out"):
        tr = trainer(model, tok, short_problems() + [long])
    assert long not in tr.problems and len(tr.problems) == 8
    with pytest.raises(ValueError, match="leaving no room for an answer"):
        trainer(model, tok, [long])


def test_kl_to_a_copy_of_the_policy_starts_at_zero_and_grows():
    model, tok = tiny()
    assert trainer(model, tok).reference is None           # kl_coef=0: no copy kept, no reference forward
    tr = trainer(model, tok, kl_coef=0.1, lr=1e-2)
    assert tr.reference is not None and not any(p.requires_grad for p in tr.reference.parameters())
    history = tr.train(3)
    assert history.kl[0] == pytest.approx(0.0, abs=1e-6) and history.kl[-1] > 0
    assert all(math.isfinite(x) for x in history.loss)
    assert set(history.phase_seconds()) == {"rollout", "reward", "reference", "update"}
    assert history.reference_s[0] > 0


def test_kl_estimators_against_the_closed_form_on_a_small_vocabulary():
    torch.manual_seed(0)
    p, q = torch.softmax(torch.randn(5), 0), torch.softmax(torch.randn(5), 0)
    exact = (p * (p / q).log()).sum()
    x = torch.multinomial(p, 200_000, replacement=True)
    k3 = kl_estimate(p.log()[x], q.log()[x], kind="k3")
    assert k3.mean().item() == pytest.approx(exact.item(), rel=0.05) and (k3 >= 0).all()


def test_resume_after_a_crash_reaches_the_same_step_and_weights(tmp_path):
    def run(directory, steps, crash_at=None):
        model, tok = tiny()
        torch.manual_seed(3)
        calls = {"n": 0}

        def reward(problem, response):
            calls["n"] += 1
            if crash_at is not None and calls["n"] > crash_at * 8:       # 8 responses per step
                raise KeyboardInterrupt("killed")
            return parity(problem, response)
        tr = GRPOTrainer(model, tok, short_problems(), reward_fn=reward, config=GRPOConfig(
            group_size=4, prompts_per_step=2, max_new_tokens=8, lr=1e-2, progress=False,
            checkpoint_dir=str(directory), checkpoint_every=1))
        try:
            tr.train(steps)
        except KeyboardInterrupt:
            pass
        return tr, model

    straight, model_a = run(tmp_path / "a", 4)
    crashed, _ = run(tmp_path / "b", 4, crash_at=2)
    assert crashed.step == 2
    resumed, model_b = run(tmp_path / "b", 4)
    assert resumed.step == 4 and resumed.history.step == [1, 2, 3, 4]
    assert resumed.history.reward == straight.history.reward
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(ValueError, match="another GRPOConfig"):
        GRPOTrainer(*tiny(), short_problems(), config=GRPOConfig(group_size=4, prompts_per_step=2,
                    max_new_tokens=8, lr=5e-3, checkpoint_dir=str(tmp_path / "a"), progress=False))


def test_evaluate_reports_pass_at_k_with_intervals():
    model, tok = tiny()
    tr = trainer(model, tok)
    problems = short_problems(6)
    result = tr.evaluate(problems, k=(1, 2), samples=3, max_new_tokens=4)
    assert len(result.correct) == 6 and result.samples == 3
    for k in (1, 2):
        want = sum(pass_at_k(3, c, k) for c in result.correct) / 6
        assert result.pass_at[k].estimate == pytest.approx(want)
        assert result.pass_at[k].low <= want <= result.pass_at[k].high
    assert tr.evaluate(problems, k=(1,), samples=3, max_new_tokens=4).correct == result.correct   # seeded
    with pytest.raises(ValueError, match="at least 4 samples"):
        tr.evaluate(problems, k=(4,), samples=2)


def test_checkers_of_lecture17_accept_right_and_reject_wrong_answers():
    from lmfs.exercises.lecture17 import check_masked_sequence_loss, check_kl_k3

    def sequence_loss(per_token, mask):
        m = mask.float()
        lengths = m.sum(1)
        per_seq = (per_token * m).sum(1) / lengths.clamp(min=1)
        return per_seq[lengths > 0].mean() if (lengths > 0).any() else per_token.sum() * 0

    assert check_masked_sequence_loss(sequence_loss) > 0
    with pytest.raises(AssertionError, match="wrong result"):       # padding counted in the mean
        check_masked_sequence_loss(lambda x, m: (x * m).sum(1).div(x.shape[1]).mean())
    assert check_kl_k3(lambda lp, ref: torch.expm1(ref - lp) - (ref - lp)) > 0
    with pytest.raises(AssertionError, match="wrong result"):       # k3 with the ratio upside down
        check_kl_k3(lambda lp, ref: torch.expm1(lp - ref) - (lp - ref))


def test_benchmark_runs_tiny(tmp_path, capsys):
    from lmfs.benchmarks.grpo import main

    path = tmp_path / "grpo.json"
    result = main(["--tiny", "--steps", "1", "--profile", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["lmfs"]["samples_per_s"] > 0 and 0 < saved["lmfs"]["useful_generation_share"] <= 1
    assert set(saved["lmfs"]["phase_share"]) >= {"rollout", "update", "between"}
    assert sum(saved["lmfs"]["phase_share"].values()) == pytest.approx(1.0)
    assert set(saved["lmfs"]["garbage_collection"]["collections"]) == {"0", "1", "2"}
    if "error" not in result["trl"]:
        assert result["trl"]["samples_per_s"] > 0 and result["ratio"] > 0
    # the profiled step: one rollout with one call of each of its parts per step or per decode step
    parts = saved["lmfs"]["profile"]["parts"]
    assert parts["rollout"]["calls"] == parts["update"]["calls"] == parts["reward"]["calls"] == 1
    assert parts["decode steps"]["calls"] >= 1 and parts["prefill"]["calls"] >= 1
    assert parts["rollout"]["wall"] >= parts["prefill"]["wall"] + parts["decode steps"]["wall"]
    assert saved["lmfs"]["profile"]["wall"] >= parts["rollout"]["wall"] + parts["update"]["wall"]
    out = capsys.readouterr().out
    assert "samples/s" in out and "under the profiler" in out


def test_forward_timer_times_every_prefill_and_decode_step():
    """The benchmark's ForwardTimer (the engine's forward_hook) sees each prefill forward and each
    decode step, of the plain and the fast runner, counts the prompt tokens as real rows, and
    leaves the engine as it was."""
    from lmfs.benchmarks.grpo import ForwardTimer
    from lmfs.fast import fast_engine
    from lmfs.inference import LLM, SamplingParams

    model, tok = tiny()
    for llm in (LLM(model, tok, progress=False), fast_engine(model, tok, progress=False)):
        timer = ForwardTimer(llm)
        llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0))
        s = llm.stats
        assert len(timer.events) == s["prefill_steps"] + s["decode_steps"] and s["prefill_steps"] >= 1
        assert timer.real_rows >= s["prefill_tokens"] + s["decode_tokens"] and timer.useful_seconds() > 0
        timer.close()
        assert llm.forward_hook is None


@pytest.mark.gpu
def test_overlapped_steps_on_cuda_train_as_steps_one_after_another():
    """On a GPU (CUDA graphs, bf16, torch's fused AdamW stepped without waiting for the loss) a
    rollout started during the update before samples what it would have sampled after it."""
    (plain, h0, early0), (overlapped, h1, early1) = (run_steps(o, device="cuda") for o in (False, True))
    assert overlapped._torch_optimizer and overlapped.llm.cuda_graphs and (early0, early1) == (0, 2)
    assert h1.reward == h0.reward and h1.response_length == h0.response_length
    for (name, a), b in zip(plain.policy.named_parameters(), overlapped.policy.parameters()):
        torch.testing.assert_close(b, a, msg=name)


@pytest.mark.gpu
def test_compiled_update_on_cuda_trains_as_the_eager_one():
    """On a GPU (fused projections, Inductor's kernels in place of lmfs's Triton ones, bf16 autocast) the
    compiled update's log-probs
    match the eager forward's to bf16 precision, and both train alike."""
    runs = compiled_and_eager_runs("cuda", steps=3)
    eager, compiled = runs[False], runs[True]
    assert compiled.history.reward[0] == eager.history.reward[0]
    assert all(math.isfinite(x) for x in compiled.history.loss)
    for (name, a), b in zip(eager.policy.named_parameters(), compiled.policy.parameters()):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=0, msg=name)
    rollout = compiled.rollout(compiled.sample_problems(7))
    for rows, ids, mask in compiled.micro_batches(rollout):
        with compiled._autocast():
            got = compiled._update_logprobs(compiled.policy, ids, mask)
            want = response_logprobs(compiled.policy, ids, mask)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_cuda_graph_rollouts_follow_in_place_updates():
    """On a GPU the engine replays CUDA graphs captured over the parameters' storage: after updates
    (in place, under bf16 autocast) its log-probs must still be those of the updated policy."""
    model, tok = tiny()
    model = model.cuda()
    tr = trainer(model, tok, lr=1e-2, kl_coef=0.1, epochs_per_batch=2)
    assert tr.llm.cuda_graphs and tr.autocast == torch.bfloat16
    before = copy.deepcopy(model.state_dict())
    history = tr.train(3)
    assert all(math.isfinite(x) for x in history.loss + history.kl)
    assert any((before[k] - v).abs().max() > 0 for k, v in model.state_dict().items())
    assert tr.llm.autocast == torch.bfloat16 and tr.llm.cache.k[0].dtype == torch.bfloat16
    rollout = tr.rollout(tr.sample_problems(7))
    batches = tr.micro_batches(rollout)
    for (rows, _, mask), logp in zip(batches, tr.logprobs_of(model, batches)):   # under the update's autocast
        for i, sampled in enumerate(rollout.sampler_logprobs[row] for row in rows):
            if sampled:   # to bf16 precision (log-probs near -5, 8-bit mantissas)
                torch.testing.assert_close(logp[i][mask[i]], torch.tensor(sampled, device="cuda"), atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_packed_update_on_cuda_matches_the_padded_one():
    """On a GPU under bf16 autocast the packed forward goes through variable-length flash attention:
    its log-probs and gradients match the padded batch's to bf16 precision, and a packed GRPO run
    keeps the rollouts' log-probs equal to the training forward's."""
    from lmfs.inference.runner import flash_varlen_supports
    from lmfs.kernels.fused import fuse_model
    from lmfs.alignment.sft import packed_response_logprobs

    model, tok = tiny()
    model = fuse_model(model.cuda(), chunked_loss=False, norms=True, embedding=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    responses = [[11, 12, 13, 14, 15, 16], [17], [18, 19]]
    ids, mask = batch_tensors(prompts, responses, "cuda")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    assert flash_varlen_supports(torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"))
    grads = []
    for packed in (False, True):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, entropy = (packed_response_logprobs(model, ids, mask, lengths) if packed
                             else response_logprobs(model, ids, mask))
        (logp.sum() + entropy.sum()).backward()
        grads.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=3e-2, rtol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(b, a, atol=5e-2, rtol=5e-2)
    model, tok = tiny()
    tr = trainer(model.cuda(), tok, lr=1e-2, packed_update=True)
    history = tr.train(2)
    assert all(math.isfinite(x) for x in history.loss)
    rollout = tr.rollout(tr.sample_problems(7))
    batches = tr.micro_batches(rollout)
    for (rows, _, mask), logp in zip(batches, tr.logprobs_of(model, batches)):
        for i, sampled in enumerate(rollout.sampler_logprobs[row] for row in rows):
            if sampled:
                torch.testing.assert_close(logp[i][mask[i]], torch.tensor(sampled, device="cuda"), atol=2e-2, rtol=0)

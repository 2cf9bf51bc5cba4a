"""lmfs.alignment.grpo: the GRPO trainer's mechanics on a tiny random model (CPU, seconds)."""

import copy
import json
import math

import pytest
import torch

from lmfs.alignment.grpo import PHASES, GRPOConfig, GRPOTrainer, batch_tensors
from lmfs.alignment.pg import aggregate, kl_estimate, pg_loss
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
    ids, mask = batch_tensors([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=77)
    assert ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 77]]
    # position t predicts token t+1: response tokens sit at 3,4 (row 0) and 1,2,3 (row 1)
    assert mask.int().tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    ids, mask = batch_tensors([[1, 2]], [[]], pad_id=0)          # an empty response: nothing scored
    assert not mask.any()


def test_micro_batches_pad_with_the_tokenizers_pad_id():
    """The trainer pads with <|endoftext|> (lmfs.alignment.sft.padding_id), not with id 0, which is a
    real token (here the byte 0)."""
    from lmfs.data.corpora import EOT

    model, tok = tiny()
    tr = trainer(model, tok, micro_batch_size=8)
    rollout = tr.rollout(tr.sample_problems(0))
    rollout.response_ids = [r[:i] for i, r in enumerate(rollout.response_ids)]     # lengths 0..7: padding
    (rows, ids, mask), = tr.micro_batches(rollout)
    lengths = torch.tensor([len(rollout.prompt_ids[i]) + len(rollout.response_ids[i]) for i in rows])
    padded = torch.arange(ids.shape[1]) >= lengths[:, None]
    assert padded.any() and tr.pad_id == tok.special_ids[EOT] != 0
    assert (ids[padded] == tok.special_ids[EOT]).all()
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> token to pad with"):
        trainer(model, Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|end|>"]))


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
                                            [rollout.response_ids[i] for i in rows], pad_id=tr.pad_id)
        assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)


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
    ids, mask = batch_tensors(rollout.prompt_ids, rollout.response_ids, pad_id=tr.pad_id)
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


def test_a_step_is_its_four_phases_called_in_order():
    """train_step is rollout -> score and micro-batches -> reference log-probs -> update: the same
    phases called by hand give the same record and weights; an unscored rollout is refused."""
    model, tok = tiny()
    ours, by_hand = trainer(copy.deepcopy(model), tok, kl_coef=0.1), trainer(copy.deepcopy(model), tok, kl_coef=0.1)
    torch.manual_seed(2)
    record = ours.train_step()
    torch.manual_seed(2)
    rollout = by_hand.rollout(by_hand.sample_problems(0))
    batches = by_hand.micro_batches(rollout)
    with pytest.raises(ValueError, match="score it"):
        by_hand.update(rollout, batches)
    by_hand.score(rollout)
    stats = by_hand.update(rollout, batches, by_hand.reference_logprobs(rollout, batches))
    assert record["reward"] == pytest.approx(rollout.rewards.mean().item()) and record["reward"] > 0
    assert record["loss"] == pytest.approx(stats["loss"], rel=1e-6, abs=1e-9)
    assert record["kl"] == pytest.approx(stats["kl"], abs=1e-9)
    assert ours.last_rollout.texts == rollout.texts == [by_hand.response_text(r) for r in rollout.response_ids]
    for (name, a), b in zip(ours.policy.named_parameters(), by_hand.policy.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    assert all(record[f"{p}_s"] > 0 for p in PHASES)


def test_phase_timer_counts_every_second_in_one_phase(monkeypatch):
    """A phase entered inside another pauses it: on a clock that ticks once per reading, the seconds
    of the nested phase are not counted in the outer one, and the total is the wall time."""
    import lmfs.train.phases as phases

    clock = iter(range(100))
    monkeypatch.setattr(phases.time, "perf_counter", lambda: float(next(clock)))
    timer = phases.PhaseTimer(PHASES)
    with timer.phase("update"):                     # reads 0
        with timer.phase("reward", sync=False):     # reads 1, 2
            pass
        with timer.phase("rollout", sync=False):    # reads 3, 4
            pass
    with timer.phase("reference"):                  # update ends at 5; reads 6, 7
        pass
    assert timer.reset() == {"rollout": 1.0, "reward": 1.0, "reference": 1.0, "update": 3.0}
    assert timer.seconds == dict.fromkeys(PHASES, 0.0)
    with pytest.raises(ValueError, match="not one of"):
        with timer.phase("old_logprob"):
            pass


def test_a_non_finite_loss_raises_and_leaves_the_weights(monkeypatch):
    from lmfs.alignment import grpo

    model, tok = tiny()
    tr = trainer(model, tok)
    before = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(grpo, "aggregate", lambda per_token, mask, **kw: per_token.sum() * float("nan"))
    with pytest.raises(FloatingPointError, match="diverged"):
        tr.train(2)
    assert tr.step == 0
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)


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
    from lmfs.alignment.pg import kl_estimate
    from lmfs.exercises.lecture17 import check_k3_gradient, check_masked_sequence_loss

    def sequence_loss(per_token, mask):
        m = mask.float()
        lengths = m.sum(1)
        per_seq = (per_token * m).sum(1) / lengths.clamp(min=1)
        return per_seq[lengths > 0].mean() if (lengths > 0).any() else per_token.sum() * 0

    assert check_masked_sequence_loss(sequence_loss) > 0
    with pytest.raises(AssertionError, match="wrong result"):       # padding counted in the mean
        check_masked_sequence_loss(lambda x, m: (x * m).sum(1).div(x.shape[1]).mean())
    def k3_gradient(logits, ref_logits, kind="k3"):
        """Autograd of each token's estimate, weighted by pi(v) and summed over the vocabulary."""
        z = logits.detach().clone().requires_grad_(True)
        logp, ref = torch.log_softmax(z, -1), torch.log_softmax(ref_logits, -1)
        (logp.exp().detach() * kl_estimate(logp, ref, kind)).sum().backward()
        return z.grad

    assert check_k3_gradient(k3_gradient) > 0
    assert check_k3_gradient(lambda z, ref: torch.softmax(z, -1) - torch.softmax(ref, -1)) > 0   # closed form
    with pytest.raises(AssertionError, match="wrong result"):       # k1: zero in expectation
        check_k3_gradient(lambda z, ref: k3_gradient(z, ref, "k1"))
    with pytest.raises(AssertionError, match="wrong result"):       # the gradient of KL(pi || pi_ref)
        check_k3_gradient(lambda z, ref: torch.func.grad(
            lambda x: (torch.softmax(x, -1) * (torch.log_softmax(x, -1) - torch.log_softmax(ref, -1))).sum())(z))


def test_benchmark_runs_tiny(tmp_path, capsys):
    from lmfs.benchmarks.grpo import main

    path = tmp_path / "grpo.json"
    result = main(["--tiny", "--steps", "1", "--profile", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["lmfs"]["samples_per_s"] > 0 and 0 < saved["lmfs"]["useful_generation_share"] <= 1
    assert set(saved["lmfs"]["phase_share"]) >= {"rollout", "update", "between"}
    assert sum(saved["lmfs"]["phase_share"].values()) == pytest.approx(1.0)
    assert set(saved["lmfs"]["garbage_collection"]["collections"]) == {"0", "1", "2"}
    # the sequential trainer's row: its samples/s as a ratio of the pipelined one's
    assert saved["sequential"]["samples_per_s"] > 0
    assert saved["sequential_ratio"] == pytest.approx(saved["sequential"]["samples_per_s"] / saved["lmfs"]["samples_per_s"])
    if "error" not in result["trl"]:
        assert result["trl"]["samples_per_s"] > 0 and result["ratio"] > 0
    # the profiled step: one rollout with one call of each of its parts per step or per decode step
    parts = saved["lmfs"]["profile"]["parts"]
    assert parts["rollout"]["calls"] == parts["update"]["calls"] == parts["reward"]["calls"] == 1
    assert parts["forwards"]["calls"] >= 2 and parts["scheduling"]["calls"] >= 2 and parts["accepting"]["calls"] >= 1
    assert parts["rollout"]["wall"] >= parts["forwards"]["wall"]
    assert saved["lmfs"]["profile"]["wall"] >= parts["rollout"]["wall"] + parts["update"]["wall"]
    out = capsys.readouterr().out
    assert "samples/s" in out and "under the profiler" in out and "sequential / pipelined" in out


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



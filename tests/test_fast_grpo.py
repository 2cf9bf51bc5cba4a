"""lmfs.fast.grpo: the pipelined GRPO trainer computes what the sequential one computes (CPU, seconds)."""

import contextlib
import copy
import math

import pytest
import torch

from lmfs.alignment.grpo import GRPOConfig, GRPOTrainer, batch_tensors
from lmfs.alignment.sft import response_logprobs
from lmfs.fast.grpo import PipelineConfig, PipelinedGRPOTrainer, packed_response_logprobs
from lmfs.nn import TransformerConfig, TransformerLM
from test_alignment_grpo import parity, short_problems, tiny, trainer


def pipelined(model, tok, problems=None, reward_fn=parity, pipeline=None, cls=PipelinedGRPOTrainer, **config):
    config = dict(dict(group_size=4, prompts_per_step=2, max_new_tokens=8, lr=1e-3, micro_batch_size=8,
                       progress=False), **config)
    return cls(model, tok, problems or short_problems(), reward_fn=reward_fn, config=GRPOConfig(**config),
               pipeline=pipeline)


class SequentialOnTheFastEngine(GRPOTrainer):
    """The sequential trainer on the pipelined one's engine (:func:`lmfs.fast.fast_engine`), so that
    comparing the two isolates the schedule. The fast engine keeps decode steps in flight, so the
    unseeded rows draw their random numbers from the global generator in another order than the
    plain runner's; tests/test_inference_fast.py compares the two engines on seeded requests."""

    make_engine = PipelinedGRPOTrainer.make_engine


def run_steps(pipeline=None, steps=3, device="cpu", **config):
    """``steps`` steps of the sequential trainer (``pipeline=None``) or the pipelined one, from the same
    model and seed, on the same engine; the trainer, its history and how many rollouts started during
    an update."""
    from lmfs.benchmarks.grpo import RolloutRecorder

    model, tok = tiny()
    model = model.to(device)
    torch.manual_seed(4)
    tr = (pipelined(model, tok, lr=1e-2, cls=lambda *a, pipeline, **k: SequentialOnTheFastEngine(*a, **k), **config)
          if pipeline is None else pipelined(model, tok, lr=1e-2, pipeline=pipeline, **config))
    recorder = RolloutRecorder(tr) if pipeline is not None else None
    history = tr.train(steps)
    if recorder is not None:
        recorder.close()
    return tr, history, recorder.early if recorder else 0


def assert_same_training(a, b, atol=1e-5):
    (ta, ha), (tb, hb) = a, b
    assert hb.reward == ha.reward and hb.response_length == ha.response_length
    assert hb.loss == pytest.approx(ha.loss, rel=1e-4, abs=1e-6)
    assert hb.kl == pytest.approx(ha.kl, rel=1e-4, abs=1e-6) or all(math.isnan(x) for x in ha.kl + hb.kl)
    assert ta.last_rollout.texts == tb.last_rollout.texts
    for (name, x), y in zip(ta.policy.named_parameters(), tb.policy.parameters()):
        torch.testing.assert_close(y, x, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("torch_adamw", [False, True])
def test_pipelined_trainer_gives_the_sequential_losses_and_weights(torch_adamw):
    """The pipelined trainer (fused policy, scoring during the update, each next rollout started once
    the optimizer step is queued; with torch's fused AdamW stepped without waiting for the loss)
    trains as the sequential one from the same seed: the same rollouts and texts, losses and
    weights; nothing is left started at the end, and a second train() call goes on from there."""
    from lmfs.kernels.fused import FusedAttention, FusedGatedMLP

    sequential, h0, _ = run_steps(None, epochs_per_batch=2, kl_coef=0.1, micro_batch_size=3)
    fast, h1, early = run_steps(PipelineConfig(torch_adamw=torch_adamw), epochs_per_batch=2, kl_coef=0.1,
                                micro_batch_size=3)
    assert early == 2                                                   # steps 2 and 3 started in the update before
    assert isinstance(fast.policy.blocks[0].attn, FusedAttention) and isinstance(fast.policy.blocks[0].mlp, FusedGatedMLP)
    assert list(fast.policy.state_dict()) == list(sequential.policy.state_dict())
    assert isinstance(fast.optimizer, torch.optim.AdamW) == torch_adamw
    assert_same_training((sequential, h0), (fast, h1))
    assert fast.started is None and fast.llm.allocator.num_used == 0
    assert len(fast.train(5).reward) == 5
    assert all(s > 0 for p in ("rollout", "reward", "update") for s in getattr(h1, f"{p}_s"))


def test_the_overlap_is_the_only_difference_of_overlap_steps():
    """Without overlap_steps no rollout starts early, and the training is the same."""
    a = run_steps(PipelineConfig(overlap_steps=False))
    b = run_steps(PipelineConfig())
    assert (a[2], b[2]) == (0, 2)
    assert_same_training(a[:2], b[:2], atol=0)


def test_the_pipelined_rollout_leaves_the_texts_to_score():
    model, tok = tiny()
    tr = pipelined(model, tok)
    rollout = tr.finish_rollout()
    assert rollout.texts == [None] * 8 and rollout.advantages is None
    tr.score(rollout)
    assert rollout.texts == [tr.response_text(r) for r in rollout.response_ids]


def test_a_non_finite_loss_leaves_the_weights_and_frees_the_started_rollout(monkeypatch):
    """Stepped without waiting for the loss, a non-finite loss is skipped on the device, the step
    raises, and the rollout it had started for the next step is closed."""
    from lmfs.alignment import grpo
    from lmfs.benchmarks.grpo import RolloutRecorder

    model, tok = tiny()
    tr = pipelined(model, tok, pipeline=PipelineConfig(torch_adamw=True))
    recorder = RolloutRecorder(tr)
    before = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(grpo, "aggregate", lambda per_token, mask, **kw: per_token.sum() * float("nan"))
    with pytest.raises(FloatingPointError, match="diverged"):
        tr.train(3)
    assert recorder.early == 1
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)
    assert tr.started is None and tr.llm.allocator.num_used == 0


def test_fused_adamw_updates_reach_an_engine_with_16_bit_weights():
    """Torch's fused AdamW writes the parameters without bumping their version counters, which the
    fused decode engine's bf16 weight copies follow: the trainer bumps them after each step, so an
    engine handed in through make_engine samples from the updated policy (as a fresh one would)."""
    pytest.importorskip("lmfs.kernels.decode")
    from lmfs.fast import fast_engine
    from lmfs.inference import SamplingParams

    class FusedDecodeTrainer(PipelinedGRPOTrainer):
        def make_engine(self, policy):
            return fast_engine(policy, None, fused_decode=True, autocast=self.autocast, progress=False)

    model, tok = tiny()
    tr = pipelined(model, tok, cls=FusedDecodeTrainer, pipeline=PipelineConfig(torch_adamw=True), lr=1e-2,
                   autocast="bf16")
    param = model.blocks[0].attn.o_proj.weight
    version = param._version
    tr.train(2)
    assert param._version > version and tr.llm.stats["fused_decode"]
    assert all(math.isfinite(x) for x in tr.history.loss)
    rollout = tr.rollout(tr.sample_problems(5))
    batches = tr.micro_batches(rollout)
    for (rows, _, mask), logp in zip(batches, tr.logprobs_of(model, batches)):
        for i, row in enumerate(rows):
            assert (logp[i][mask[i]] - torch.tensor(rollout.sampler_logprobs[row])).abs().max() < 1e-2
    prompts, params = tr.prompts[:3], SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=True)
    fresh = fast_engine(model, None, fused_decode=True, autocast=torch.bfloat16, progress=False).generate(prompts, params)
    assert ([(o.token_ids, o.logprobs) for o in tr.llm.generate(prompts, params)]
            == [(o.token_ids, o.logprobs) for o in fresh])


def test_packed_update_trains_as_the_padded_one(monkeypatch):
    """packed_update computes the update's forward (and the reference's) on the sequences packed into
    one row (no padding): the same rewards, KL, losses and weights as the padded update, over several
    micro-batches and epochs."""
    import lmfs.fast.grpo as fast

    calls = []
    packed = fast.packed_response_logprobs
    monkeypatch.setattr(fast, "packed_response_logprobs", lambda model, *args: calls.append(model) or packed(model, *args))
    config = dict(micro_batch_size=3, epochs_per_batch=2, kl_coef=0.1, steps=2)
    padded = run_steps(PipelineConfig(), **config)
    assert calls == []
    tr, history, _ = run_steps(PipelineConfig(packed_update=True), **config)
    # per step: 3 micro-batches for the reference, 3 per epoch for the policy
    assert sum(m is tr.reference for m in calls) == 2 * 3 and sum(m is tr.policy for m in calls) == 2 * 2 * 3
    assert_same_training(padded[:2], (tr, history), atol=1e-4)   # (Adam scales rounding in tiny gradients up)


def test_pipeline_config_refuses_what_does_not_go_together():
    with pytest.raises(ValueError, match="packed_update=True needs fused_model=True"):
        PipelineConfig(packed_update=True, fused_model=False)
    with pytest.raises(ValueError, match="packed_update=True and compile_update=True"):
        PipelineConfig(packed_update=True, compile_update=True)


def test_compiled_update_trains_as_the_eager_one():
    """compile_update runs the update's forward, log-probs and entropy through torch.compile (dynamic
    shapes: micro-batches of 3 and 2 sequences, lengths changing between steps): the same rewards,
    losses and weights as the eager update."""
    eager, h0, _ = run_steps(PipelineConfig(), steps=2, micro_batch_size=3)
    compiled, h1, _ = run_steps(PipelineConfig(compile_update=True), steps=2, micro_batch_size=3)
    assert hasattr(compiled.update_logprobs, "_torchdynamo_orig_callable")
    assert not hasattr(eager.update_logprobs, "_torchdynamo_orig_callable")
    assert_same_training((eager, h0), (compiled, h1))


def test_a_failed_compilation_warns_and_the_update_runs_without_it():
    """If torch.compile fails in the first update (an Inductor error, say), the trainer warns with
    the reason and trains on without it: the same step as an eager trainer's."""
    import torch._dynamo

    eager = pipelined(*tiny(), lr=1e-2, pipeline=PipelineConfig(fused_model=False))
    failing = pipelined(*tiny(), lr=1e-2, pipeline=PipelineConfig(fused_model=False, compile_update=True))
    calls = []

    class CompileError(torch._dynamo.exc.BackendCompilerFailed):   # (its constructor varies between versions)
        def __init__(self, message):
            RuntimeError.__init__(self, message)

    def broken(*args):
        calls.append(1)
        raise CompileError("no kernel for this shape")

    failing.update_logprobs = broken
    torch.manual_seed(2)
    h0 = eager.train(1)
    torch.manual_seed(2)
    with pytest.warns(RuntimeWarning, match="compile_update: torch.compile failed .*no kernel for this shape"):
        h1 = failing.train(1)
    assert calls == [1] and failing.update_logprobs is response_logprobs
    assert h1.reward == h0.reward and h1.loss == pytest.approx(h0.loss, rel=1e-5, abs=1e-7)
    for (name, a), b in zip(eager.policy.named_parameters(), failing.policy.parameters()):
        torch.testing.assert_close(b, a, msg=name)


def _ragged_batch(vocab=50, rows=6, seed=1):
    """Right-padded prompt + response rows of different lengths (one response empty), and the lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 6, (rows,), generator=g)]
    responses = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
                 for n in torch.randint(1, 12, (rows,), generator=g)]
    responses[2] = []
    ids, mask = batch_tensors(prompts, responses, pad_id=0)
    return ids, mask, [len(p) + len(r) for p, r in zip(prompts, responses)]


@pytest.mark.parametrize("variant", [{}, dict(n_kv_heads=2), dict(window=5), dict(attn_softcap=20.0)],
                         ids=["mha", "gqa", "window", "softcap"])
def test_packed_response_logprobs_equal_the_padded_ones(variant, monkeypatch):
    """The sequences packed into one row, each attending only to itself, give the padded batch's
    log-probs, entropies and gradients (plain model on the padded batch vs the fused copy packed);
    attending across the packed sequences would not."""
    from lmfs.kernels.fused import fuse_model

    torch.manual_seed(0)
    plain = TransformerLM(TransformerConfig(vocab_size=50, context_length=32, d_model=32, n_layers=2, n_heads=4,
                                            **variant))
    fused = fuse_model(copy.deepcopy(plain), chunked_loss=False, norms=True, embedding=True)
    ids, mask, lengths = _ragged_batch()
    assert sum(lengths) < ids.numel()                                 # there is padding to leave out
    logp, entropy = response_logprobs(plain, ids, mask)
    packed_logp, packed_entropy = packed_response_logprobs(fused, ids, mask, lengths)
    torch.testing.assert_close(packed_logp, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_entropy, entropy, atol=1e-5, rtol=0)
    (logp.sum() + entropy.sum()).backward()
    (packed_logp.sum() + packed_entropy.sum()).backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=0, msg=name)
    # Without packed_documents the row is one long causal sequence, each reading the ones before it.
    monkeypatch.setattr("lmfs.fast.grpo.packed_documents", lambda model, lengths: contextlib.nullcontext())
    with torch.no_grad():
        across, _ = packed_response_logprobs(fused, ids, mask, lengths)
    assert (across - logp).abs().max() > 1e-3           # (100x the tolerance above)


def top_k_masked(logits, k=5):
    """-inf outside each position's top ``k`` logits, as top-k sampling masks them."""
    return logits.masked_fill(logits < logits.topk(k, dim=-1).values[..., -1:], float("-inf"))


def test_packed_entropy_is_finite_where_logits_are_minus_infinity():
    """With top-k-masked logits, the packed entropies are those of the k kept logits alone, and the
    gradient is finite (exp(-inf) * -inf would make both NaN)."""
    from lmfs.kernels.fused import fuse_model

    torch.manual_seed(0)
    model = fuse_model(TransformerLM(TransformerConfig(vocab_size=50, context_length=32, d_model=32, n_layers=1,
                                                       n_heads=4)), chunked_loss=False)
    head = model.head
    object.__setattr__(model, "head", lambda x: top_k_masked(head(x)))      # (an instance attribute over the method)
    ids, mask, lengths = _ragged_batch()
    logp, entropy = packed_response_logprobs(model, ids, mask, lengths)
    with torch.no_grad():
        kept = head(model.hidden(ids[:, :-1], None)).topk(5, dim=-1).values      # (B, T-1, 5)
    want = torch.distributions.Categorical(logits=kept).entropy() * mask
    assert torch.isinf(model.head(model.hidden(ids[:1], None))).any() and torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, want, atol=1e-5, rtol=0)
    entropy.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_packed_response_logprobs_refuse_a_plain_model_and_bad_lengths(monkeypatch):
    from lmfs.kernels.fused import fuse_model

    model = TransformerLM(TransformerConfig(vocab_size=50, context_length=32, d_model=16, n_layers=1, n_heads=2))
    ids, mask, lengths = _ragged_batch()
    with pytest.raises(TypeError, match="fuse it first"):
        packed_response_logprobs(model, ids, mask, lengths)
    fuse_model(model, chunked_loss=False)
    with pytest.raises(ValueError, match="lengths must give"):
        packed_response_logprobs(model, ids, mask, lengths[:-1])
    with pytest.raises(ValueError, match="lengths must give"):
        packed_response_logprobs(model, ids, mask, [0] + lengths[1:])
    monkeypatch.setattr("lmfs.kernels.fused.MASKED_PACKING_TOKENS", sum(lengths) - 1)
    with pytest.raises(ValueError, match="without flash attention"):
        packed_response_logprobs(model, ids, mask, lengths)


@pytest.mark.gpu
def test_pipelined_steps_on_cuda_train_as_the_sequential_ones():
    """On a GPU (CUDA graphs, bf16, torch's fused AdamW stepped without waiting for the loss) the
    pipelined trainer samples what the sequential one samples. Its weights are compared with the same
    trainer run without the overlap: the sequential trainer computes through the plain modules and
    lmfs's AdamW, whose bf16 rounding differs from the fused kernels' (the CPU test above compares
    the two trainers' weights exactly), so the schedule is what this comparison isolates."""
    sequential, h0, _ = run_steps(None, device="cuda")
    unoverlapped, h2, none_early = run_steps(PipelineConfig(overlap_steps=False), device="cuda")
    fast, h1, early = run_steps(PipelineConfig(), device="cuda")
    assert fast.torch_adamw and early == 2 and none_early == 0
    assert h1.reward[0] == h0.reward[0] and all(math.isfinite(x) for x in h1.loss)
    assert h1.reward == h2.reward
    for (name, a), b in zip(unoverlapped.policy.named_parameters(), fast.policy.parameters()):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=0, msg=name)


@pytest.mark.gpu
def test_compiled_update_on_cuda_trains_as_the_eager_one():
    """On a GPU (fused projections, Inductor's kernels in place of lmfs's Triton ones, bf16 autocast)
    the compiled update's log-probs match the eager forward's to bf16 precision, and both train alike."""
    eager, h0, _ = run_steps(PipelineConfig(), device="cuda", micro_batch_size=3)
    compiled, h1, _ = run_steps(PipelineConfig(compile_update=True), device="cuda", micro_batch_size=3)
    assert h1.reward[0] == h0.reward[0] and all(math.isfinite(x) for x in h1.loss)
    for (name, a), b in zip(eager.policy.named_parameters(), compiled.policy.parameters()):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=0, msg=name)
    rollout = compiled.rollout(compiled.sample_problems(7))
    for rows, ids, mask in compiled.micro_batches(rollout):
        with compiled.autocast_context():
            got = compiled.update_logprobs(compiled.policy, ids, mask)
            want = response_logprobs(compiled.policy, ids, mask)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_packed_update_on_cuda_matches_the_padded_one():
    """On a GPU under bf16 autocast the packed forward goes through variable-length flash attention:
    its log-probs and gradients match the padded batch's to bf16 precision, and a packed GRPO run
    keeps the rollouts' log-probs equal to the training forward's."""
    from lmfs.batching import flash_varlen_supports
    from lmfs.kernels.fused import fuse_model

    model, tok = tiny()
    model = fuse_model(model.cuda(), chunked_loss=False, norms=True, embedding=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    responses = [[11, 12, 13, 14, 15, 16], [17], [18, 19]]
    ids, mask = batch_tensors(prompts, responses, "cuda", pad_id=0)
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
    tr = pipelined(model.cuda(), tok, lr=1e-2, pipeline=PipelineConfig(packed_update=True))
    history = tr.train(2)
    assert all(math.isfinite(x) for x in history.loss)
    rollout = tr.rollout(tr.sample_problems(7))
    batches = tr.micro_batches(rollout)
    for (rows, _, mask), logp in zip(batches, tr.logprobs_of(model, batches)):
        for i, sampled in enumerate(rollout.sampler_logprobs[row] for row in rows):
            if sampled:
                torch.testing.assert_close(logp[i][mask[i]], torch.tensor(sampled, device="cuda"), atol=2e-2, rtol=0)

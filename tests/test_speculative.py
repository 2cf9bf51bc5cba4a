"""Speculative decoding keeps the target's distribution: closed form, statistical tests, greedy equality;
its rounds run on the device without a host transfer, so a CUDA graph can capture them.

The statistical tests use Pearson's chi-square test at a stated false-alarm rate ALPHA = 1e-3: a
correct sampler fails it with probability 1e-3 for a random seed, and never for the fixed seeds
used here (the outcome is deterministic). The same test must reject a wrong rule (always accepting
the draft, which samples from the draft's distribution), showing that it has the power to catch one.
"""

import copy
import itertools

import pytest
import torch
from helpers import HostTransfers, model_of, tiny

from lmfs.eval import chi_square_test
from lmfs.inference.speculative import (SpeculativeDecoder, acceptance_probability, speculative_generate,
                                        speculative_step, speculative_step_distribution)
from lmfs.nn.generate import generate

ALPHA = 1e-3  # false-alarm rate of every chi-square test in this file
V = 8


def random_distributions(seed: int, n: int = 1, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(n, V, generator=g, dtype=torch.float64), dim=-1)


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor, min_expected: float = 0.0) -> float:
    """p-value of "``tokens`` are draws from ``probs``" (V,) (:func:`lmfs.eval.chi_square_test`)."""
    return chi_square_test(torch.bincount(tokens, minlength=probs.numel()), probs, min_expected)[0]


def test_step_distribution_is_the_target_distribution():
    p, q = random_distributions(0, 5), random_distributions(1, 5)
    q[0, 3] = 0.0  # a token the draft never proposes must still come out with p's probability
    q[0] /= q[0].sum()
    torch.testing.assert_close(speculative_step_distribution(p, q), p)
    torch.testing.assert_close(speculative_step_distribution(p, p), p)  # nothing rejected
    # and the acceptance probability is 1 − TV(p, q)
    torch.testing.assert_close(acceptance_probability(p, q), 1 - 0.5 * (p - q).abs().sum(-1))


def test_step_samples_the_target_distribution_chi_square():
    p, q = random_distributions(2)[0], random_distributions(3)[0]
    n = 200_000
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(q, n, replacement=True, generator=g)  # draft tokens, x ~ q
    accepted, token = speculative_step(p.expand(n, V), q.expand(n, V), x, g)
    assert chi_square_pvalue(token, p) > ALPHA
    # The acceptance rate matches Σ min(p, q) within 5 standard deviations of a binomial mean.
    rate, expected = accepted.double().mean().item(), acceptance_probability(p, q).item()
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / n) ** 0.5
    assert 0.2 < expected < 0.95  # p and q differ enough for rejections to matter
    # A wrong rule, always accepting, emits x ~ q: the same test rejects it.
    assert chi_square_pvalue(x, p) < ALPHA


def models(vocab_size=V, draft_seed=1, init_std=0.5):
    """A target and a smaller, differently initialised draft, both peaked (large init_std) so that
    the draft is often wrong and the rejection path runs."""
    target = model_of(tiny(vocab_size=vocab_size, init_std=init_std), seed=0).eval()
    draft = model_of(tiny(vocab_size=vocab_size, init_std=init_std, n_layers=1, d_model=16, n_heads=2),
                     seed=draft_seed).eval()
    return target, draft


def test_greedy_equals_target_greedy_decoding():
    target, draft = models(vocab_size=50, init_std=0.1)
    idx = torch.tensor([[1, 7, 3]])
    for k in (1, 3, 5):
        ids, stats = speculative_generate(target, draft, idx, 12, k=k, temperature=0)
        assert torch.equal(ids, generate(target, idx, 12, temperature=0))
        assert stats["accepted"] < stats["proposed"]  # rejections happened (the draft is a different model)
    # the draft as its own target: everything is accepted, k + 1 tokens per target call
    ids, stats = speculative_generate(target, target, idx, 12, k=3, temperature=0)
    assert torch.equal(ids, generate(target, idx, 12, temperature=0))
    assert stats["acceptance_rate"] == 1.0 and stats["target_calls"] == 3


@pytest.mark.parametrize("fields", [dict(attention="mla", kv_latent_dim=8), dict(window=3, n_kv_heads=2),
                                    dict(positions="learned"), dict(qk_norm=True, attn_softcap=5.0, logit_softcap=3.0),
                                    dict(moe_experts=4, moe_top_k=2)])
def test_greedy_equality_for_model_variants(fields):
    target = model_of(tiny(init_std=0.1, **fields), seed=0).eval()
    draft = model_of(tiny(n_layers=1, **fields), seed=1).eval()
    idx = torch.tensor([[5, 9, 2, 7]])
    ids, stats = speculative_generate(target, draft, idx, 12, k=3, temperature=0)
    assert torch.equal(ids, generate(target, idx, 12, temperature=0))
    assert 1 <= stats["tokens_per_target_call"] <= 4


def test_decoder_serves_many_prompts_and_plain_decoding():
    """One decoder, reused: prompts of other lengths (a single token too) give what fresh decoders give,
    and the plain decoder (no draft, k = 0) is the target's greedy decoding, one token per round."""
    target, draft = models(vocab_size=50, init_std=0.1)
    spec = SpeculativeDecoder(target, draft, k=2, max_len=16, temperature=0)
    plain = SpeculativeDecoder(target, None, k=0, max_len=16, temperature=0)
    for prompt in ([3], [4, 8, 1, 1, 6], [2, 2]):
        idx = torch.tensor([prompt])
        n = 16 - len(prompt)
        expected = generate(target, idx, n, temperature=0)
        assert torch.equal(spec.generate(idx, n)[0], expected)
        ids, stats = plain.generate(idx, n)
        assert torch.equal(ids, expected) and stats["target_calls"] == n and stats["proposed"] == 0
    with pytest.raises(ValueError, match="max_len"):
        spec.generate(torch.tensor([[1, 2]]), 15)
    with pytest.raises(ValueError, match="k=0"):
        SpeculativeDecoder(target, draft, k=0)
    with pytest.raises(ValueError, match="k=2"):
        SpeculativeDecoder(target, None, k=2)


@pytest.mark.parametrize("k, sampling", [(2, dict(temperature=0)), (3, dict(temperature=0.8, top_k=5, top_p=0.9)),
                                         (0, dict(temperature=1.0))])
def test_round_moves_nothing_between_host_and_device(k, sampling):
    # A round is what the CUDA graph captures: a Python number made into a tensor or a value read
    # back inside it would fail the capture on a GPU (HostTransfers catches both on the CPU).
    target, draft = models(vocab_size=50, init_std=0.1)
    decoder = SpeculativeDecoder(target, draft if k else None, k=k, **sampling)
    round_, found = decoder.decode_round, set()

    def watched():
        with HostTransfers() as mode:
            round_()
        found.update(mode.found)

    decoder.decode_round = watched
    ids, _ = decoder.generate(torch.tensor([[1, 7, 3]]), 10, torch.Generator().manual_seed(0))
    assert ids.shape == (1, 13)
    assert not found, f"a round copies between host and device (fails under CUDA graph capture): {found}"


def test_top_k_one_is_greedy_and_seeds_reproduce():
    target, draft = models(vocab_size=50, init_std=0.1)
    idx = torch.tensor([[4, 2]])
    ids, _ = speculative_generate(target, draft, idx, 8, k=2, temperature=1.0, top_k=1)
    assert torch.equal(ids, generate(target, idx, 8, temperature=0))
    a, _ = speculative_generate(target, draft, idx, 8, generator=torch.Generator().manual_seed(3))
    b, _ = speculative_generate(target, draft, idx, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (1, 10)


@torch.no_grad()
def exact_joint(model, prompt: list[int], n: int) -> torch.Tensor:
    """The model's exact probability (V**n,) of every continuation ``t_1 .. t_n`` of ``prompt`` at
    temperature 1 (index ``t_1·V^(n−1) + ... + t_n``), by enumeration with the uncached model."""
    prefixes, weights = [()], torch.ones(1, dtype=torch.float64)
    for _ in range(n):
        probs = torch.softmax(model(torch.tensor([prompt + list(c) for c in prefixes]))[0][:, -1].double(), dim=-1)
        weights = (weights[:, None] * probs).flatten()
        prefixes = [c + (t,) for c, t in itertools.product(prefixes, range(V))]
    return weights


def test_generated_sequences_follow_the_target_chi_square():
    """End to end, through both caches and their truncation: the joint distribution of the first
    three generated tokens over many seeded runs matches the target's exact one."""
    target, _ = models()
    draft = copy.deepcopy(target)  # a perturbed copy: agrees often (whole steps accepted), not always
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    prompt, runs, n = [3, 1], 600, 3
    g = torch.Generator().manual_seed(0)
    codes, accepted, proposed, all_accepted = [], 0, 0, 0
    for _ in range(runs):
        ids, stats = speculative_generate(target, draft, torch.tensor([prompt]), n, k=2, generator=g)
        codes.append(sum(int(t) * V ** (n - 1 - i) for i, t in enumerate(ids[0, len(prompt):])))
        accepted, proposed = accepted + stats["accepted"], proposed + stats["proposed"]
        all_accepted += stats["target_calls"] == 1
    codes = torch.tensor(codes)
    # the rejection path, the bonus token and the caches' truncation all ran often
    assert 0.3 < accepted / proposed < 0.9 and all_accepted > runs // 5
    assert chi_square_pvalue(codes, exact_joint(target, prompt, n), min_expected=5) > ALPHA
    # The test has the power to see a wrong distribution: the same runs against the draft's
    # distribution fail it.
    assert chi_square_pvalue(codes, exact_joint(draft, prompt, n), min_expected=5) < ALPHA


def test_errors():
    target, draft = models()
    other, _ = models(vocab_size=9)
    idx = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, other, idx, 4)
    with pytest.raises(ValueError, match="one sequence"):
        speculative_generate(target, draft, torch.tensor([[1], [2]]), 4)
    with pytest.raises(ValueError, match="k"):
        speculative_generate(target, draft, idx, 4, k=0)
    with pytest.raises(ValueError, match="context_length"):
        speculative_generate(target, draft, idx, 15)
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, draft, idx[:, :0], 4)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, draft, idx, 4, temperature=-1)
    ids, stats = speculative_generate(target, draft, idx, 0)
    assert torch.equal(ids, idx) and stats["target_calls"] == 0


# ---------------------------------------------------------------------------------------------
# GPU: the captured rounds give the target's greedy tokens

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_rounds_gpu(dtype):
    config = dict(vocab_size=97, context_length=64, init_std=0.3)   # the draft is often wrong, not always
    target = model_of(tiny(**config), seed=0).eval().cuda().to(dtype)
    draft = model_of(tiny(**config, n_layers=1, d_model=16, n_heads=2), seed=1).eval().cuda().to(dtype)
    idx = torch.tensor([[5, 9, 2, 7, 11]], device="cuda")

    def run(k, graphs, temperature, seed=0):
        decoder = SpeculativeDecoder(target, draft if k else None, k=k, temperature=temperature, cuda_graphs=graphs)
        outs = [decoder.generate(idx, 40, torch.Generator(device="cuda").manual_seed(seed)) for _ in range(2)]
        assert (decoder.graph is not None) == graphs, "no CUDA graph was captured"
        assert torch.equal(outs[0][0], outs[1][0])   # the second call replays the graph the first captured
        return outs[0]

    expected = generate(target, idx, 40, temperature=0)
    for k in (0, 1, 4):
        ids, stats = run(k, True, 0.0)
        # the replayed graph computes what the eager rounds compute; in float32 that is the target's greedy
        # decoding (in bfloat16 the cached and uncached forwards may round a near tie differently)
        assert torch.equal(ids, run(k, False, 0.0)[0]), k
        if dtype == torch.float32:
            assert torch.equal(ids, expected), k
        assert k == 0 or stats["accepted"] < stats["proposed"]
    ids, stats = run(3, True, 1.0)   # sampling: the same draws from the same generator
    assert torch.equal(ids, run(3, False, 1.0)[0]) and 0 < stats["acceptance_rate"] < 1

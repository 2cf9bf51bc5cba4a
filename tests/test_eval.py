"""lmfs.eval: scorers against direct log-prob sums, pass@k against enumeration, bits-per-byte by
hand, the sandbox against hostile programs, statistics against scipy, tasks against their sources."""

import itertools
import math
import os
import time

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F
from helpers import model_of, tiny

from lmfs.data.corpora import EOT, generate_stories, iter_stories
from lmfs.eval import (MCItem, NgramIndex, arithmetic, arithmetic_mc, bits_per_byte, bootstrap_ci, check_code,
                       encode_pair, evaluate_generation, evaluate_multiple_choice, exact_match, extract_answer,
                       few_shot_context, generate, humaneval, mean_pass_at_k, min_k_prob, ngram_overlap,
                       numbers_match, paired_bootstrap, paired_permutation_test, pass_at_k, read_jsonl, roc_auc,
                       run_python, score_continuations, score_continuations_one_at_a_time, sign_test,
                       sliding_windows, story_facts, target_logprobs, target_logprobs_one_at_a_time, task_path,
                       text_perplexity, token_perplexity, word_ngrams)
from lmfs.eval.tasks import TASKS
from lmfs.tokenization import Tokenizer, train_bpe


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "stories.txt"
    path.write_text(generate_stories(20_000, seed=0))
    vocab, merges = train_bpe(path, 320, [EOT])
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="module")
def model(tokenizer):
    return model_of(tiny(vocab_size=tokenizer.vocab_size, context_length=64)).eval()


@torch.no_grad()
def direct_logprob(model, ids: list[int], start: int) -> float:
    """log p(ids[start:] | ids[:start]) from one plain forward and a per-position loop."""
    logits, _ = model(torch.tensor([ids[:-1]]))
    logp = F.log_softmax(logits[0].double(), dim=-1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids)))


# ------------------------------------------------------------------------------------------------
# pass@k and statistics


def test_pass_at_k_equals_enumeration_over_all_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    # Stable for large n where the binomials overflow floats; and the naive estimate is biased.
    assert 0 < pass_at_k(2000, 3, 100) < 1
    assert pass_at_k(5, 1, 2) != pytest.approx(1 - (1 - 1 / 5) ** 2)
    assert mean_pass_at_k([4, 4], [0, 4], 2) == 0.5
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_bootstrap_interval_matches_normal_approximation():
    rng = np.random.default_rng(0)
    values = rng.random(400) < 0.7
    ci = bootstrap_ci(values, n_resamples=4000)
    half = 1.96 * math.sqrt(values.mean() * (1 - values.mean()) / len(values))
    assert ci.low < ci.estimate == values.mean() < ci.high
    assert (ci.high - ci.low) / 2 == pytest.approx(half, rel=0.15)
    # Another statistic goes through the generic path.
    med = bootstrap_ci(rng.normal(size=50), statistic=np.median, n_resamples=500)
    assert med.low <= med.estimate <= med.high


def test_paired_comparisons_against_scipy_and_brute_force():
    rng = np.random.default_rng(1)
    a = (rng.random(12) < 0.8).astype(float)
    b = (rng.random(12) < 0.4).astype(float)
    # Sign test = exact binomial test on the discordant pairs.
    wins, losses = int(np.sum(a > b)), int(np.sum(a < b))
    assert sign_test(a, b) == pytest.approx(scipy.stats.binomtest(wins, wins + losses).pvalue)
    # Permutation test with full enumeration = brute force over all 2^n sign patterns.
    d = a - b
    flips = [abs(np.mean(np.array(s) * d)) >= abs(d.mean()) - 1e-12
             for s in itertools.product((1, -1), repeat=len(d))]
    assert paired_permutation_test(a, b) == pytest.approx(np.mean(flips))
    # Identical models: no difference; very different ones: a clear one.
    same = paired_bootstrap(a, a)
    assert same.diff == 0 and same.p_value == 1.0
    x = np.ones(200)
    y = (rng.random(200) < 0.5).astype(float)
    far = paired_bootstrap(x, y, n_resamples=2000)
    assert far.low > 0 and far.p_value < 0.01
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap(a, b[:-1])


# ------------------------------------------------------------------------------------------------
# Log-probabilities, perplexity, bits-per-byte


def test_batched_target_logprobs_equal_one_at_a_time(model):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 65, 2, 30, 31, 12, 64, 9]
    sequences = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    starts = [1, 40, 1, 3, 30, 11, 1, 4]
    batched = target_logprobs(model, sequences, starts, batch_size=3)
    single = target_logprobs_one_at_a_time(model, sequences, starts)
    for seq, start, b, s in zip(sequences, starts, batched, single):
        assert len(b.logprobs) == len(seq) - start
        torch.testing.assert_close(b.logprobs, s.logprobs, atol=1e-5, rtol=1e-5)
        assert torch.equal(b.greedy, s.greedy)
        assert float(b.logprobs.double().sum()) == pytest.approx(direct_logprob(model, seq, start), abs=1e-4)
    with pytest.raises(ValueError, match="context_length"):
        target_logprobs(model, [list(range(70))], [1])
    with pytest.raises(ValueError, match="start"):
        target_logprobs(model, [[1, 2]], [2])


@pytest.mark.gpu
def test_batched_target_logprobs_on_gpu_in_bf16():
    """On CUDA, in bf16 (how the benchmark runs): the batched path agrees with the reference."""
    model = model_of(tiny(vocab_size=1000, context_length=256, d_model=128)).cuda().to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 257, (40,), generator=g).tolist()
    sequences = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    starts = [max(1, len(s) - 7) for s in sequences]
    batched = target_logprobs(model, sequences, starts, batch_size=16)
    for b, s in zip(batched, target_logprobs_one_at_a_time(model, sequences, starts)):
        torch.testing.assert_close(b.logprobs, s.logprobs, atol=0.1, rtol=0.05)   # bf16 matmuls differ by shape


def test_sliding_windows_score_every_token_once():
    for n, ctx, stride in [(10, 4, 2), (100, 16, 16), (17, 16, 1), (3, 16, None), (50, 8, 5)]:
        scored = []
        for begin, end, start in sliding_windows(n, ctx, stride):
            assert end - begin <= ctx + 1 and start >= 1
            scored += range(begin + start, end)
        assert scored == list(range(1, n))


def test_perplexity_by_window_equals_a_per_token_loop(model):
    """Stride 1 gives every token the longest context possible: check against a loop doing exactly that."""
    ctx = model.config.context_length
    tokens = torch.randint(0, model.config.vocab_size, (ctx + 20,), generator=torch.Generator().manual_seed(3)).tolist()
    nll = 0.0
    for t in range(1, len(tokens)):
        window = tokens[max(0, t - ctx):t + 1]
        nll -= direct_logprob(model, window, len(window) - 1)
    result = token_perplexity(model, tokens, stride=1)
    assert result.n_tokens == len(tokens) - 1
    assert result.nll == pytest.approx(nll, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(nll / (len(tokens) - 1)), rel=1e-5)
    # Coarser strides score the same tokens with less context (never fewer tokens).
    assert token_perplexity(model, tokens).n_tokens == len(tokens) - 1


def test_bits_per_byte_equals_a_hand_computation(model, tokenizer):
    assert bits_per_byte(math.log(2) * 10, 5) == 2.0
    text = "Lily had a red ball. The dog ran to the park!"
    ids = [tokenizer.special_ids[EOT]] + tokenizer.encode(text)
    nll = -direct_logprob(model, ids, 1)                  # every token of the text, after <|endoftext|>
    hand = nll / math.log(2) / len(text.encode("utf-8"))
    result = text_perplexity(model, tokenizer, text)
    assert result.n_tokens == len(ids) - 1 and result.n_bytes == len(text.encode())
    assert result.bpb == pytest.approx(hand, rel=1e-5)
    # Documents are scored separately and their totals add up.
    two = text_perplexity(model, tokenizer, [text, text])
    assert two.nll == pytest.approx(2 * result.nll) and two.bpb == pytest.approx(result.bpb)


# ------------------------------------------------------------------------------------------------
# Multiple choice


def test_encode_pair_follows_the_joint_tokenization(tokenizer):
    ctx, cont = encode_pair(tokenizer, "Lily went to ", "the park")
    assert ctx == tokenizer.encode("Lily went to") and ctx + cont == tokenizer.encode("Lily went to the park")
    assert encode_pair(tokenizer, "", "hi") == ([tokenizer.special_ids[EOT]], tokenizer.encode("hi"))


def test_multiple_choice_scorer_equals_direct_logprob_sum(model, tokenizer):
    items = story_facts(6)
    pairs = [(it.context, " " + c) for it in items for c in it.choices]
    scores = score_continuations(model, tokenizer, pairs, batch_size=5)
    reference = score_continuations_one_at_a_time(model, tokenizer, pairs)
    for (context, cont), s, r in zip(pairs, scores, reference):
        whole = tokenizer.encode(context + cont)
        ctx = tokenizer.encode(context)
        assert whole[:len(ctx)] == ctx             # so the split below is the natural one
        ids = whole[-(model.config.context_length + 1):]
        assert s.logprob == pytest.approx(direct_logprob(model, ids, len(ids) - (len(whole) - len(ctx))), abs=1e-4)
        assert s.logprob == pytest.approx(r.logprob, abs=1e-4) and s.greedy == r.greedy
        assert s.n_tokens == len(whole) - len(ctx) and s.n_bytes == len(cont.encode())


def test_evaluate_multiple_choice_normalisations_and_batching(model, tokenizer):
    items = story_facts(9) + arithmetic_mc(6)
    result = evaluate_multiple_choice(model, tokenizer, items, batch_size=7)
    reference = evaluate_multiple_choice(model, tokenizer, items, one_at_a_time=True)
    for norm in ("raw", "token", "byte"):
        assert np.array_equal(result.correct[norm], reference.correct[norm])
    for item, scores, raw, tok, byte in zip(items, result.scores, result.correct["raw"], result.correct["token"],
                                            result.correct["byte"]):
        lp = np.array([s.logprob for s in scores])
        assert raw == (np.argmax(lp) == item.answer)
        assert tok == (np.argmax(lp / [s.n_tokens for s in scores]) == item.answer)
        assert byte == (np.argmax(lp / [len(c.encode()) for c in item.choices]) == item.answer)
    assert result.n_items == 15 and result.tokens_scored > 0
    assert result.acc == result.correct["raw"].mean()


def test_few_shot_prompts_are_seeded_and_exclude_the_item():
    pool = [MCItem(f"q{i}", ["a", "b"], i % 2, f"id{i}") for i in range(10)]
    first = few_shot_context(pool[0], pool, n_shot=3, seed=0)
    assert first == few_shot_context(pool[0], pool, n_shot=3, seed=0)
    assert first.endswith("\n\nq0") and "q0 " not in first and first.count("\n\n") == 3
    assert any(few_shot_context(pool[0], pool, 3, seed=s) != first for s in range(1, 5))
    with pytest.raises(ValueError, match="pool"):
        few_shot_context(pool[0], pool[:2], n_shot=2)


# ------------------------------------------------------------------------------------------------
# Generation and verification


def test_generate_backends_agree_greedy_and_cut_at_stop(model, tokenizer):
    prompts = ["Lily went to", "Once upon a time,"]
    engine = generate(model, tokenizer, prompts, max_tokens=12, stop=(), backend="engine")
    nn = generate(model, tokenizer, prompts, max_tokens=12, stop=(), backend="nn")
    assert engine == nn and all(len(c) == 1 for c in engine)
    full = engine[0][0]
    stop = full[3:5]
    assert generate(model, tokenizer, prompts[:1], max_tokens=12, stop=(stop,))[0][0] == full[:full.find(stop)]
    assert generate(model, tokenizer, [""], max_tokens=5, stop=())[0][0] == generate(
        model, tokenizer, [EOT], max_tokens=5, stop=(), backend="nn")[0][0]
    samples = generate(model, tokenizer, prompts[:1], max_tokens=8, temperature=1.0, n=3, seed=5, stop=())
    assert samples == generate(model, tokenizer, prompts[:1], max_tokens=8, temperature=1.0, n=3, seed=5, stop=())


def test_answer_extraction_and_verifiers():
    assert extract_answer("The answer is 19.") == "19"
    assert extract_answer("3 + 4 = 7, so #### 1,024 apples") == "1,024"
    assert extract_answer("no digits") is None and extract_answer("\n  Tom  \ny", "line") == "Tom"
    assert numbers_match("0.5", "1/2") and numbers_match("1,024", "1024") and numbers_match("$7", "7.0")
    assert not numbers_match("19", "18") and not numbers_match(None, "1") and not numbers_match("abc", "1")
    assert exact_match("The  Park!", "park") and not exact_match("the garden", "the park")


def test_evaluate_generation_scores_what_it_extracts(model, tokenizer):
    items = arithmetic(4)
    result = evaluate_generation(model, tokenizer, items, n_shot=1, max_tokens=4, n=2, temperature=1.0)
    assert result.correct.shape == (4, 2)
    for item, extracted, row in zip(items, result.extracted, result.correct):
        assert list(row) == [numbers_match(e, item.answer) for e in extracted]
    assert 0 <= result.pass_at(1) <= result.pass_at(2) <= 1


def test_humaneval_is_real_and_checked_by_execution():
    problems = humaneval()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    few = problems[:3]
    completions = [[p.canonical_solution, "    return None\n"] for p in few]
    passed = check_code(few, completions, timeout=10)
    assert passed[:, 0].all() and not passed[:, 1].any()


# ------------------------------------------------------------------------------------------------
# The sandbox


HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "timeout"),
    "sleep": ("import time\ntime.sleep(60)\n", "timeout"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", ("error", "timeout")),   # which comes first: load
    "subprocess": ("import subprocess\nsubprocess.run(['sleep', '60'])\n", ("error", "timeout")),
    "huge allocation": ("x = bytearray(50 * 2**30)\n", "memory"),
    "sys.exit": ("import sys\nsys.exit(0)\nraise SystemExit\n", "error"),
    "os._exit": ("import os\nos._exit(0)\n", "error"),
    "stdout flood": ("while True:\n    print('x' * 10_000)\n", "output_limit"),
    "kill the parent": ("import os\nos.kill(os.getppid(), 9)\n", "error"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_sandbox_contains_hostile_programs(name):
    code, status = HOSTILE[name]
    start = time.perf_counter()
    result = run_python(code, timeout=1.5, memory_mb=256, max_output_bytes=100_000)
    assert result.status in ((status,) if isinstance(status, str) else status), (result.status, result.stderr[-300:])
    assert not result.passed and time.perf_counter() - start < 10
    assert len(result.stdout) <= 100_000
    assert os.getpid() > 0                  # still here


def test_sandbox_passes_a_complete_program():
    result = run_python("import math\nprint(math.factorial(5))\n")
    assert result.passed and result.stdout == "120\n" and result.returncode == 0
    failing = run_python("assert 1 == 2\n")
    assert failing.status == "error" and "AssertionError" in failing.stderr


# ------------------------------------------------------------------------------------------------
# Contamination


def test_ngram_overlap_finds_copied_items():
    train = list(itertools.islice(iter_stories(0), 30))
    assert word_ngrams("A b, c! A b", 2) == {("a", "b"), ("b", "c"), ("c", "a")}
    seen = train[3].split("\n\n")[0]
    unseen = next(iter_stories(1000)).split("\n\n")[0]
    overlap = ngram_overlap([seen, unseen], train, n=8)
    assert overlap[0] == 1.0 and overlap[1] < 0.5
    assert NgramIndex(train, n=8).contaminated(seen) and not NgramIndex(train, n=50).contaminated(unseen)


def test_min_k_prob_matches_its_definition_and_detects_training_members(tokenizer):
    model = model_of(tiny(vocab_size=tokenizer.vocab_size, context_length=64))
    bos = tokenizer.special_ids[EOT]
    # Texts of exactly 40 tokens (after <|endoftext|>), so the members train as one batch.
    stories = [tokenizer.decode(tokenizer.encode(s)[:40]) for s in itertools.islice(iter_stories(2000), 16)]
    batch = torch.tensor([[bos] + tokenizer.encode(t) for t in stories[:8]])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):                                  # memorise the members
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    scores = min_k_prob(model, tokenizer, stories, k=0.2)
    # The definition, by hand for one text.
    ids = [bos] + tokenizer.encode(stories[0])
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    lp = F.log_softmax(logits[0].double(), -1)[torch.arange(len(ids) - 1), ids[1:]].sort().values
    assert scores[0] == pytest.approx(float(lp[:math.ceil(0.2 * len(lp))].mean()), abs=1e-4)
    auc = roc_auc(scores[:8], scores[8:])
    assert auc >= 0.9
    from sklearn.metrics import roc_auc_score
    assert auc == pytest.approx(roc_auc_score([1] * 8 + [0] * 8, scores))


# ------------------------------------------------------------------------------------------------
# Tasks


def test_generated_tasks_are_correct_and_stored():
    for item in arithmetic(50, ops="+-*"):
        expression = item.prompt.removeprefix("Question: What is ").split("?")[0]
        assert int(item.answer) == eval(expression)
    for item in arithmetic_mc(20):
        expression = item.context.split("is ")[1].split("?")[0]
        assert len(set(item.choices)) == 4 and eval(expression) == int(item.choices[item.answer])
    for item in story_facts(30):
        story, question = item.context.rsplit("\n\n", 1)
        assert f"{question} {item.choices[item.answer]}" in story    # the fact is restated from the story
        assert len(set(item.choices)) == 4 and sum(f"{question} {c}" in story for c in item.choices) == 1
    for name, make in TASKS.items():                 # data/eval holds exactly what the generators make
        assert read_jsonl(task_path(name)) == make(), f"data/eval/{name}.jsonl is stale: run python -m lmfs.eval"


def test_chi_square_test_matches_scipy_and_pools_rare_cells():
    scipy_stats = pytest.importorskip("scipy.stats")
    from lmfs.eval import chi_square_test

    probs = np.array([0.4, 0.3, 0.2, 0.1])
    counts = np.array([45, 28, 19, 8])
    p, dof = chi_square_test(counts, probs)
    assert dof == 3 and abs(p - scipy_stats.chisquare(counts, 100 * probs).pvalue) < 1e-12
    # Cells expected to get fewer than 5 draws (here 0.02·100 and 0.03·100) become one cell.
    probs, counts = np.array([0.55, 0.4, 0.02, 0.03]), np.array([50, 44, 4, 2])
    p, dof = chi_square_test(counts, probs)
    assert dof == 2 and abs(p - scipy_stats.chisquare([50, 44, 6], [55, 40, 5]).pvalue) < 1e-12


def test_extract_choice_reads_the_chosen_letter_in_free_text():
    """Multiple choice by generation: the letter a reply picks, wherever it says so, and None where
    the reply names no letter of the choices (an article "A" or "a" is no choice)."""
    from lmfs.eval import extract_choice

    cases = {"The answer is (C).": 2, "Answer: D": 3, "B) the park": 1, "(A) because": 0, "C": 2, "A.": 0,
             "I doubt (B) and (C), so the answer is A": 0, "the park, so (B)": 1, "A cat sat.": None,
             "the answer is a cat": None, "E) beyond the choices": None, "no letter here": None}
    assert {text: extract_choice(text, 4) for text in cases} == cases
    with pytest.raises(ValueError, match="n_choices"):
        extract_choice("A", 0)

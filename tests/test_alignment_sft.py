"""lmfs.alignment: tasks and checkers, SFT (masking, packing, log-probs, accumulation), reward model, DPO."""

import copy
import doctest
import filecmp
import math
import re

import pytest
import torch
import torch.nn.functional as F

from lmfs.alignment import grpo, sft, tasks
from lmfs.alignment.base import _store, pretraining_text, train_tokenizer
from lmfs.alignment.preference import (RewardModel, bradley_terry_loss, dpo_loss, dpo_metrics, reward_accuracy,
                                       score_pairs, sequence_logprob, train_dpo, train_reward_model)
from lmfs.alignment.sft import (END, IGNORE, SPECIAL_TOKENS, USER, accumulate_sft_gradients, encode_example, end_id,
                                format_prompt, generate_responses, pack, pad_batch,
                                response_logprobs, sft_loss, token_losses, train_sft)
from lmfs.alignment.tasks import (Problem, arithmetic_problems, check_answer, check_countdown, countdown_problems,
                                  extract_answer, instruction_examples, load_records, load_split, preference_pairs,
                                  split_of)
from lmfs.exercises.lecture15 import check_dpo_loss, check_sft_labels
from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.tokenization import Tokenizer


@pytest.fixture(scope="module")
def tok():
    """A byte-level tokenizer (no merges) with the chat template's special tokens."""
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], list(SPECIAL_TOKENS))


def tiny_model(vocab_size, context_length=160, seed=0):
    torch.manual_seed(seed)
    return TransformerLM(TransformerConfig(vocab_size=vocab_size, context_length=context_length, d_model=32,
                                           n_layers=1, n_heads=2))


# ---------------------------------------------------------------------------------------------
# Tasks and data


def test_arithmetic_problems_and_checker():
    problems = arithmetic_problems(50, digits=2, ops="+-", seed=1)
    assert len({p.prompt for p in problems}) == 50
    for p in problems:
        a, op, b = p.meta["a"], p.meta["op"], p.meta["b"]
        assert 10 <= a < 100 and 10 <= b < 100 and p.difficulty == 2
        assert int(p.answer) == (a + b if op == "+" else a - b)
        assert check_answer(p, f"some working\nAnswer: {p.answer}") == 1.0
        assert check_answer(p, f"Answer: {p.answer}.") == 1.0
        assert check_answer(p, f"Answer: {int(p.answer) + 1}") == 0.0
        assert check_answer(p, p.answer) == 0.0                       # no "Answer:" line
    # only the last "Answer:" counts
    p = problems[0]
    assert check_answer(p, f"Answer: {p.answer}\nAnswer: 1234567") == 0.0
    assert extract_answer("x\nAnswer:  42 \nmore") == "42" and extract_answer("none") is None
    assert check_answer(p, "Answer: forty") == 0.0


def test_countdown_problems_and_checker():
    for n_numbers in (3, 4):
        problems = countdown_problems(40, n_numbers=n_numbers, seed=2)
        for p in problems:
            assert p.difficulty == n_numbers and len(p.meta["numbers"]) == n_numbers
            assert check_answer(p, tasks.countdown_response(p)) == 1.0, (p, tasks.countdown_response(p))
    numbers, target = [3, 7, 25], 46
    assert check_countdown(numbers, target, "3 * 7 + 25")
    assert check_countdown(numbers, target, "(25 + 3 * 7) = 46")
    assert check_countdown(numbers, 8, "(25 - 3) / 7 * 0 + 8") is False   # 8 and 0 are not given
    assert not check_countdown(numbers, 50, "25 + 25")                 # 25 used twice
    assert not check_countdown(numbers, 46, "46")
    assert not check_countdown(numbers, 10, "7 + 3.0")                 # integers only
    assert not check_countdown(numbers, 0, "__import__('os').getcwd()")
    assert not check_countdown(numbers, 1, "3 ** 0")
    assert not check_countdown(numbers, 1, "7 / (3 - 3)")
    assert check_countdown([4, 2, 8], 1, "8 / 4 / 2")                  # exact fractions


def test_split_is_disjoint_and_consistent():
    # every generator's items lie in the split asked for, and the stored splits share no question
    for split in ("train", "test"):
        for p in arithmetic_problems(200, 2, "+", seed=0, split=split):
            assert split_of(f"{p.meta['a']}+{p.meta['b']}") == split
    for name in ("arithmetic", "countdown"):
        train, test = load_split(name, "train"), load_split(name, "test")
        assert train and test and not {p.prompt for p in train} & {p.prompt for p in test}
    train_i, test_i = load_split("instructions", "train"), load_split("instructions", "test")
    assert not {i for i, _ in train_i} & {i for i, _ in test_i}
    train_p, test_p = load_split("preferences", "train"), load_split("preferences", "test")
    assert not {p for p, _, _ in train_p} & {p for p, _, _ in test_p}
    # held-out problems never appear among the training instructions or preferences
    held_out = {p.prompt for name in ("arithmetic", "countdown") for p in load_split(name, "test")}
    assert not held_out & {i for i, _ in train_i} and not held_out & {p for p, _, _ in train_p}
    # the 2-digit additions the RL lectures evaluate on
    assert sum(p.difficulty == 2 and p.meta["op"] == "+" for p in load_split("arithmetic", "test")) == 150


def test_stored_data_is_rebuilt_identically(tmp_path):
    for path in tasks.write_data(tmp_path):
        assert filecmp.cmp(path, tasks.DATA_DIR / path.name, shallow=False), \
            f"{path.name} differs from data/alignment: run `python -m lmfs.alignment data`"
    assert sum((tasks.DATA_DIR / p.name).stat().st_size for p in tmp_path.iterdir()) < 2_000_000


def test_instructions_and_preferences_are_right():
    for (instruction, response), record in zip(load_split("instructions", "train")[:300],
                                               load_records("instructions", "train")):
        assert extract_answer(response) is not None
        if record["kind"] == "arithmetic":
            a, op, b = instruction.removeprefix("What is ").removesuffix("?").split()
            p = Problem(instruction, str(int(a) + int(b) if op == "+" else int(a) - int(b)), "arithmetic", 0)
            assert check_answer(p, response) == 1.0
    flaws = set()
    for (prompt, chosen, rejected), record in zip(preference_pairs(60, seed=3), tasks._preference_items(60, 3, None)):
        assert chosen != rejected and extract_answer(chosen) is not None
        flaws.add(record[0])
        if record[0] == "no_answer":
            assert extract_answer(rejected) is None
    assert flaws == {"wrong", "no_answer", "off_topic"}
    assert instruction_examples(5, seed=4) == instruction_examples(5, seed=4)


def test_docstring_examples():
    for module in (tasks, sft, grpo):
        assert doctest.testmod(module).failed == 0


def test_pretraining_text_holds_no_test_problem_and_digits_are_tokens(tmp_path):
    text = pretraining_text(20_000, 400, 40, seed=0)
    sums = re.findall(r"(\d+) ([-+]) (\d+) = ", text) + re.findall(r"What is (\d+) ([-+]) (\d+)\?", text)
    assert len(sums) > 300 and all(split_of(f"{a}{op}{b}") == "train" for a, op, b in sums)
    assert "<|assistant|>" in text and "<|endoftext|>" in text
    tokenizer = train_tokenizer(text, 400, 50_000, tmp_path)
    assert {t for t in SPECIAL_TOKENS} <= set(tokenizer.special_ids)
    with_digits = [b for i, b in tokenizer.vocab.items() if re.search(rb"[0-9]", b)]
    assert sorted(with_digits) == [str(d).encode() for d in range(10)]   # only the ten single digits


def test_pretraining_text_digit_shares_and_chat_arithmetic():
    text = pretraining_text(2_000, 800, 4, seed=0, digit_shares=((1, 1.0),), chat_arithmetic=0.5)
    bare = re.findall(r"^(\d+) ([-+]) (\d+) = (-?\d+)$", text, flags=re.M)
    chat = re.findall(r"<\|user\|>\s*What is (\d+) ([-+]) (\d+)\?", text)
    asked = re.findall(r"Question: What is (\d+) ([-+]) (\d+)\?", text)
    assert all(len(x) == 1 for a, _, b, *_ in bare + chat + asked for x in (a, b))      # one-digit operands only
    assert all(int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)) for a, op, b, c in bare)
    n = len(bare) + len(chat) + len(asked)
    assert n > 700 and 0.4 < len(chat) / n < 0.6 and 0.15 < len(bare) / n < 0.35     # half chat, the rest split
    assert not re.search(r"What is \d\d", pretraining_text(2_000, 800, 4, seed=0, digit_shares=((1, 1.0),)))


def test_cache_folders_appear_whole_or_not_at_all(tmp_path):
    folder = tmp_path / "base-x"

    def broken(staging):
        (staging / "model.pt").write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        _store(folder, broken)
    assert not folder.exists() and list(tmp_path.iterdir()) == []      # nothing half-written is left
    _store(folder, lambda staging: (staging / "meta.json").write_text("first"))
    _store(folder, lambda staging: (staging / "meta.json").write_text("second"))  # a slower twin: dropped
    assert (folder / "meta.json").read_text() == "first" and list(tmp_path.iterdir()) == [folder]


# ---------------------------------------------------------------------------------------------
# SFT


def test_encode_example_masks_the_prompt(tok):
    ids, mask = encode_example(tok, "What is 2 + 3?", "Answer: 5")
    prompt_ids = tok.encode(format_prompt("What is 2 + 3?"))
    assert ids[:len(prompt_ids)] == prompt_ids and not any(mask[:len(prompt_ids)])
    assert all(mask[len(prompt_ids):]) and ids[-1] == tok.special_ids[END]
    assert tok.decode(ids[len(prompt_ids):-1]) == "Answer: 5"
    assert encode_example(tok, format_prompt("What is 2 + 3?"), "Answer: 5") == (ids, mask)  # already formatted
    assert format_prompt("hi").startswith(USER)


def test_bad_examples_raise(tok):
    with pytest.raises(ValueError, match="response .* is empty"):
        encode_example(tok, "What is 2 + 3?", "")
    with pytest.raises(ValueError, match="context_length=20: shorten"):
        encode_example(tok, "What is 2 + 3? " * 5, "Answer: 5", context_length=20)
    with pytest.raises(ValueError, match="more than context_length=8"):
        pack([encode_example(tok, "a", "b")], 8)


def test_pack_labels_by_hand(tok):
    examples = [encode_example(tok, "x", "yz"), encode_example(tok, "uv", "w"), encode_example(tok, "a" * 30, "b")]
    batch = pack(examples, 48, pad_id=0)
    n0, n1 = len(examples[0][0]), len(examples[1][0])
    assert batch["input_ids"].shape == (2, 48)                         # the third does not fit the first row
    row = batch["input_ids"][0].tolist()
    assert row[:n0] == examples[0][0] and row[n0:n0 + n1] == examples[1][0]
    assert batch["positions"][0, n0].item() == 0 and batch["positions"][0, n0 + 1].item() == 1
    # by hand: position t gets token t+1 iff that token is in the same example and a response token
    want = [IGNORE] * 48
    for start, (ids, mask) in ((0, examples[0]), (n0, examples[1])):
        for t in range(len(ids) - 1):
            if mask[t + 1]:
                want[start + t] = ids[t + 1]
    assert batch["labels"][0].tolist() == want
    assert (batch["labels"][0, n0 + n1:] == IGNORE).all()             # padding carries no loss


def test_prompt_tokens_carry_no_loss(tok):
    examples = [encode_example(tok, f"What is {i} + {i}?", f"Answer: {2 * i}") for i in range(6)]
    batch = pack(examples, 64, pad_id=tok.special_ids["<|endoftext|>"])
    model = tiny_model(tok.vocab_size, 64)
    logits = model(batch["input_ids"], positions=batch["positions"])[0].detach().requires_grad_(True)
    total, count = token_losses(logits, batch["labels"])
    total.backward()
    ignored = batch["labels"] == IGNORE
    assert (logits.grad[ignored] == 0).all() and (logits.grad[~ignored].abs().sum(-1) > 0).all()
    # changing the logits of prompt (and padding) positions leaves the loss as it was
    moved = logits.detach() + 5 * torch.randn_like(logits) * ignored[..., None]
    assert torch.allclose(token_losses(moved, batch["labels"])[0], total)
    # the hand computation: -log softmax at each response token, averaged
    logp = torch.log_softmax(logits.detach().double(), -1)
    hand = -torch.stack([logp[b, t, batch["labels"][b, t]] for b, t in (~ignored).nonzero().tolist()]).mean()
    assert count == sum(sum(m) for _, m in examples)                  # every response token and <|end|>
    assert torch.allclose(sft_loss(model, batch).double(), hand, atol=1e-5)


def test_response_logprobs_match_categorical(tok):
    model = tiny_model(tok.vocab_size)
    input_ids, mask = pad_batch([encode_example(tok, "What is 1 + 1?", "1 + 1 = 2.\nAnswer: 2"),
                                 encode_example(tok, "Say hi.", "hi")], pad_id=0)
    logp, entropy = response_logprobs(model, input_ids, mask)
    assert logp.shape == entropy.shape == (2, input_ids.shape[1] - 1)
    dist = torch.distributions.Categorical(logits=model(input_ids[:, :-1])[0].float())
    want_logp, want_entropy = dist.log_prob(input_ids[:, 1:]), dist.entropy()
    m = mask[:, 1:]
    torch.testing.assert_close(logp[m], want_logp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[m], want_entropy[m], atol=1e-5, rtol=1e-5)
    assert (logp[~m] == 0).all() and (entropy[~m] == 0).all()
    torch.testing.assert_close(sequence_logprob(model, input_ids, mask), (want_logp * m).sum(-1), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="mask must be"):
        response_logprobs(model, input_ids, mask[:, :3])


def test_entropy_is_finite_where_logits_are_minus_infinity():
    """Top-k-masked logits (-inf outside each position's top 5): response_logprobs's entropy is that
    of the 5 kept logits alone, and its gradient is finite (exp(-inf) * -inf would give NaN)."""

    class TopK(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, idx, positions=None):
            logits = self.model(idx, positions=positions)[0]
            return (logits.masked_fill(logits < logits.topk(5, dim=-1).values[..., -1:], float("-inf")),)

    torch.manual_seed(0)
    model = TopK(TransformerLM(TransformerConfig(vocab_size=50, context_length=16, d_model=16, n_layers=1, n_heads=2)))
    ids = torch.randint(0, 50, (3, 10))
    mask = torch.ones(3, 9, dtype=torch.bool)
    logp, entropy = response_logprobs(model, ids, mask)
    with torch.no_grad():
        kept = model.model(ids[:, :-1])[0].topk(5, dim=-1).values
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=kept).entropy(), atol=1e-5, rtol=0)
    entropy.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_accumulated_gradient_equals_full_batch(tok):
    # rows with very different numbers of response tokens: a mean of micro-batch means would differ
    examples = [encode_example(tok, "q" * (1 + 5 * i), "r" * (1 + 7 * (i % 3))) for i in range(8)]
    batch = pack(examples, 64, pad_id=0)
    assert batch["input_ids"].shape[0] >= 4
    model = tiny_model(tok.vocab_size, 64)
    full = sft_loss(model, batch)
    full.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = accumulate_sft_gradients(model, batch, micro_batch_size=1)
    assert math.isclose(loss, full.item(), rel_tol=1e-5)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-4)


def test_train_sft_learns_the_format(tok):
    examples = [(f"What is {i} + 1?", f"Answer: {i + 1}") for i in range(10)]
    model = tiny_model(tok.vocab_size, 64)
    history = train_sft(model, examples, tok, steps=40, batch_size=4, micro_batch_size=2, lr=1e-2,
                        val_examples=examples[:4], progress=False)
    assert len(history.loss) == 40 and history.loss[-1] < 0.5 * history.loss[0]
    assert history.val_loss and history.val_loss[-1] < history.loss[0]


def test_generate_responses_is_greedy_decoding(tok):
    model = tiny_model(tok.vocab_size).eval()
    instructions = ["What is 1 + 1?", "Say hi."]
    replies = generate_responses(model, tok, instructions, max_tokens=10)
    for instruction, reply in zip(instructions, replies):
        ids = torch.tensor([tok.encode(format_prompt(instruction))])
        out = []
        with torch.no_grad():
            for _ in range(10):                                        # one full forward per token
                nxt = model(ids)[0][0, -1].argmax().item()
                if nxt == end_id(tok):
                    break
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert reply == tok.decode(out)
    assert len(generate_responses(model, tok, instructions, max_tokens=4, temperature=1.0, seed=0, n=3)) == 6


# ---------------------------------------------------------------------------------------------
# Reward model and DPO


def test_bradley_terry_is_the_logistic_loss():
    rc, rr = torch.randn(64), torch.randn(64)
    want = F.binary_cross_entropy_with_logits(rc - rr, torch.ones(64))
    torch.testing.assert_close(bradley_terry_loss(rc, rr), want)
    assert reward_accuracy(torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, 3.0, 0.0])) == pytest.approx(1 / 3)


def test_dpo_loss_closed_form():
    # by hand: chosen reward 0.1 * (-5 + 6) = 0.1, rejected 0.1 * (-9 + 7) = -0.2, margin 0.3
    loss, chosen, rejected = dpo_loss(torch.tensor([-5.0]), torch.tensor([-9.0]), torch.tensor([-6.0]),
                                      torch.tensor([-7.0]), beta=0.1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.3)), rel=1e-6)
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.2)
    # a policy equal to its reference: all rewards 0, loss log 2
    x = torch.randn(5)
    assert dpo_loss(x, x + 1, x, x + 1, 0.5)[0].item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, 0.0)


def test_reward_model_ignores_padding_and_learns(tok):
    rm = RewardModel(tiny_model(tok.vocab_size))
    torch.nn.init.normal_(rm.head.weight)
    ids, _ = encode_example(tok, "What is 1 + 1?", "Answer: 2")
    short = rm(torch.tensor([ids]), torch.tensor([len(ids)]))
    padded = rm(torch.tensor([ids + [0] * 9]), torch.tensor([len(ids)]))
    torch.testing.assert_close(short, padded)
    pairs = [(f"What is {i} + 2?", f"Answer: {i + 2}", f"I like {i} cats.") for i in range(12)]
    rm = RewardModel(tiny_model(tok.vocab_size))
    history = train_reward_model(rm, pairs, tok, steps=25, batch_size=6, lr=3e-3, val_pairs=pairs[:6],
                                 progress=False)
    assert history["loss"][0] == pytest.approx(math.log(2), rel=1e-4)  # a zero head: every score is 0
    assert history["val_accuracy"][-1] == 1.0 and history["loss"][-1] < 0.3
    rc, rr = score_pairs(rm, tok, pairs[:6])
    assert reward_accuracy(rc, rr) == 1.0


def test_train_dpo_raises_the_margin(tok):
    pairs = [(f"What is {i} + 2?", f"Answer: {i + 2}", f"I do not know {i}.") for i in range(8)]
    reference = tiny_model(tok.vocab_size)
    policy = copy.deepcopy(reference)
    start = dpo_metrics(policy, reference, tok, pairs, beta=0.5)
    assert start["loss"] == pytest.approx(math.log(2), abs=1e-5) and start["margin"] == pytest.approx(0, abs=1e-5)
    history = train_dpo(policy, reference, pairs, tok, steps=20, batch_size=4, beta=0.5, lr=1e-2,
                        val_pairs=pairs, progress=False)
    assert history["val_margin"][-1] > 0.2 and history["val_accuracy"][-1] >= 0.75, history
    assert history["val_loss"][-1] < math.log(2) - 0.1
    assert all(not p.requires_grad for p in reference.parameters())
    with pytest.raises(ValueError, match="same model"):
        train_dpo(policy, policy, pairs, tok, steps=1, batch_size=2, progress=False)


# ---------------------------------------------------------------------------------------------
# Exercise checkers


def test_sft_labels_checker():
    def sft_labels(ids, mask):
        return [ids[t + 1] if t + 1 < len(ids) and mask[t + 1] else -100 for t in range(len(ids))]

    assert check_sft_labels(sft_labels) == 5
    with pytest.raises(AssertionError, match="sft_labels: wrong result"):    # the mask of the token itself
        check_sft_labels(lambda ids, mask: [ids[t + 1] if t + 1 < len(ids) and mask[t] else -100
                                            for t in range(len(ids))])


def test_dpo_loss_checker():
    def dpo(pc, pr, rc, rr, beta):
        return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()

    assert check_dpo_loss(dpo) == 4
    with pytest.raises(AssertionError, match="dpo_loss: wrong result"):     # beta left out
        check_dpo_loss(lambda pc, pr, rc, rr, beta: -F.logsigmoid((pc - rc) - (pr - rr)).mean())

"""The lm-eval adapter: EleutherAI's evaluator, run here offline on a task stored on disk, puts the
same numbers on an lmfs model as lmfs.eval's own harness."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import model_of, tiny

from lmfs.data.corpora import EOT, generate_stories
from lmfs.eval import arithmetic_mc, evaluate_multiple_choice, story_facts, write_jsonl
from lmfs.tokenization import Tokenizer, train_bpe

pytest.importorskip("lm_eval", reason="the adapter needs lm-eval (a test dependency)")
from lm_eval.api.instance import Instance  # noqa: E402

from lmfs.eval.lm_eval_adapter import LmfsLM, mc_task_config, run_lm_eval  # noqa: E402


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "stories.txt"
    path.write_text(generate_stories(20_000, seed=0))
    vocab, merges = train_bpe(path, 320, [EOT])
    tokenizer = Tokenizer(vocab, merges, [EOT])
    return model_of(tiny(vocab_size=tokenizer.vocab_size, context_length=128), seed=1).eval(), tokenizer


def test_lm_eval_scores_a_local_task_like_lmfs_eval(lm, tmp_path):
    model, tokenizer = lm
    items = story_facts(12) + arithmetic_mc(12)
    path = write_jsonl(items, tmp_path / "local_task.jsonl")
    out = run_lm_eval(model, tokenizer, [mc_task_config("lmfs_local_mc", path)], log_samples=True)
    metrics = out["results"]["lmfs_local_mc"]
    ours = evaluate_multiple_choice(model, tokenizer, items)
    assert metrics["acc,none"] == pytest.approx(ours.acc)
    assert metrics["acc_bytes,none"] == pytest.approx(ours.acc_byte)
    assert metrics["acc_norm,none"] == pytest.approx(ours.acc_byte)      # ASCII choices: characters = bytes
    # Item by item, choice by choice: lm-eval's log-likelihoods are lmfs.eval's.
    samples = sorted(out["samples"]["lmfs_local_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(items)
    for sample, scores in zip(samples, ours.scores):
        theirs = [float(r[0][0]) for r in sample["resps"]]
        assert theirs == pytest.approx([s.logprob for s in scores], abs=1e-4)


def test_adapter_requests_against_direct_computation(lm):
    model, tokenizer = lm
    adapter = LmfsLM(model, tokenizer, batch_size=4)
    text = "Tom had a blue kite. The wind was strong."
    ids = [tokenizer.special_ids[EOT]] + tokenizer.encode(text)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0][0].double(), -1)
    direct = float(logp[torch.arange(len(ids) - 1), ids[1:]].sum())
    rolling = adapter.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert rolling[0] == pytest.approx(direct, abs=1e-4)
    context, continuation = "Tom had a blue", " kite"
    n_ctx = len(tokenizer.encode(context))
    whole = tokenizer.encode(context + continuation)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([whole[:-1]]))[0][0].double(), -1)
    direct = sum(float(logp[t - 1, whole[t]]) for t in range(n_ctx, len(whole)))
    (logprob, greedy), = adapter.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    assert logprob == pytest.approx(direct, abs=1e-4) and isinstance(greedy, bool) and math.isfinite(logprob)
    request = Instance("generate_until", {}, ("Tom had a", {"until": ["."], "max_gen_toks": 10}), 0)
    texts = adapter.generate_until([request])
    assert len(texts) == 1 and "." not in texts[0]

"""Log-likelihood scoring of a multiple-choice task: batched vs one item at a time vs ``lm-eval``'s HF backend.

    python -m lmfs.benchmarks evaluation [--json results/h200/evaluation.json] [--tiny] [--items N]

The task is lecture 12's story-fact reading questions (:func:`lmfs.eval.story_facts`), each with
``shots`` solved examples in front, four choices per item: every (prompt, " " + choice) pair is a
sequence to score, ``log p(choice | prompt)`` summed over the choice's tokens. The tokenizer is a
BPE trained on the course's generated stories (:func:`lmfs.train.prepare_tokens`); the model is
Llama-shaped with random weights (throughput does not depend on what the weights learned), bf16 on
CUDA, float32 on the CPU. Three ways to score the same pairs:

a. **lmfs batched**: :func:`lmfs.eval.score_continuations`: the pairs sorted by length, longest
   first, right-padded into batches of ``batch_size``; only the positions of the choice's tokens
   go through the output head.
b. **lmfs one at a time**: :func:`lmfs.eval.score_continuations_one_at_a_time`: one forward per
   pair and a log-softmax over every position: the reference every other row is compared with
   (``max |Δ|``, nats per pair).
c. **lm-eval HF**: ``lm_eval.models.huggingface.HFLM`` around the same weights converted to
   ``LlamaForCausalLM`` (:func:`lmfs.nn.to_hf_llama`), with the same tokenizer as a Hugging Face
   fast tokenizer (:func:`lmfs.tokenization.hf.hf_tokenizer`) and the same batch size, answering the same
   ``loglikelihood`` requests. It also sorts by length and batches.

Tokens/s counts the tokens that go through the model (prompt and choice, cut to the context as
every scorer cuts it), the same count for every row; times include tokenization in every row.
Goals on one H200: batched ≥ 5× one at a time, and ≥ 1.0× ``lm-eval``. Without a GPU (or with
``--tiny``) both comparisons run in one CPU run on a tiny model, to exercise the code (a test
does); those numbers say little about a GPU. A peer that fails prints an error row; the rest goes on.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from lmfs.bench import error_line, save_json
from lmfs.eval import encode_pair, few_shot_context, score_continuations, score_continuations_one_at_a_time, story_facts
from lmfs.nn import TransformerConfig, TransformerLM, to_hf_llama
from lmfs.tokenization.hf import hf_tokenizer


@dataclass(frozen=True)
class Sizes:
    story_bytes: int      # text the tokenizer is trained on
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    context_length: int
    items: int            # multiple-choice items (four pairs each)
    shots: int            # solved examples before each question
    batch_size: int       # sequences per forward, for lmfs and lm-eval alike
    repeats: int          # timed runs of the batched peers (median); one-at-a-time runs once


GPU_SIZES = Sizes(story_bytes=1_000_000, vocab_size=2_048, d_model=1024, n_layers=16, n_heads=16,
                  context_length=1024, items=500, shots=3, batch_size=64, repeats=3)
CPU_SIZES = Sizes(story_bytes=200_000, vocab_size=512, d_model=64, n_layers=2, n_heads=4,
                  context_length=256, items=40, shots=1, batch_size=16, repeats=1)


def make_pairs(tokenizer, sizes: Sizes) -> list[tuple[str, str]]:
    """The (prompt, " " + choice) pairs of ``sizes.items`` story-fact items with ``sizes.shots`` shots."""
    items = story_facts(sizes.items)
    pool = story_facts(max(sizes.shots + 1, 50), seed=2000)       # solved examples, other stories
    return [(few_shot_context(item, pool, sizes.shots), " " + choice) for item in items for choice in item.choices]


def tokens_scored(tokenizer, pairs, context_length: int) -> int:
    """Tokens that go through the model: each pair's ids, cut to ``context_length + 1``, minus one."""
    return sum(min(len(c) + len(t), context_length + 1) - 1 for c, t in (encode_pair(tokenizer, *p) for p in pairs))


def _timed(fn: Callable[[], list[float]], device: torch.device, repeats: int) -> tuple[float, list[float]]:
    """Median wall time of ``repeats`` calls (synchronised) and the last call's log-probs."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out


def lm_eval_scorer(model: TransformerLM, tokenizer, device: torch.device, batch_size: int):
    """A function scoring pairs with ``lm-eval``'s ``HFLM`` around ``model``'s weights as HF Llama."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaForCausalLM

    state, config = to_hf_llama(model)
    config._attn_implementation = "sdpa"
    dtype = next(model.parameters()).dtype
    hf_model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    hf_model.load_state_dict(state)
    lm = HFLM(pretrained=hf_model, tokenizer=hf_tokenizer(tokenizer), batch_size=batch_size,
              max_length=model.config.context_length, device=str(device))

    def score(pairs):
        # HFLM logs one line per pair it cuts to the context (every scorer here cuts the same way)
        logging.getLogger("lm_eval.models.huggingface").setLevel(logging.ERROR)
        requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                    for i, pair in enumerate(pairs)]
        return [logprob for logprob, _ in lm.loglikelihood(requests, disable_tqdm=True)]

    return score


def run(sizes: Sizes | None = None, device=None, hf: bool = True) -> dict:
    """Score the same pairs three ways; print the table; return the numbers."""
    from lmfs.train import prepare_tokens

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    sizes = sizes or (GPU_SIZES if cuda else CPU_SIZES)
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        print("no CUDA GPU: a tiny model on the CPU, both comparisons in this one run; "
              "the goals (5x one at a time, 1x lm-eval) are for one H200")
    tokenizer = prepare_tokens("stories", n_bytes=sizes.story_bytes, vocab_size=sizes.vocab_size).tokenizer
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=tokenizer.vocab_size, context_length=sizes.context_length,
                               d_model=sizes.d_model, n_layers=sizes.n_layers, n_heads=sizes.n_heads)
    model = TransformerLM(config).to(device=device, dtype=dtype).eval()
    pairs = make_pairs(tokenizer, sizes)
    n_tokens = tokens_scored(tokenizer, pairs, sizes.context_length)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
              "sizes": asdict(sizes), "params": model.num_params(), "pairs": len(pairs), "tokens": n_tokens,
              "rows": {}}

    peers = {"lmfs batched": (lambda: lambda p: [s.logprob for s in score_continuations(
                                  model, tokenizer, p, sizes.batch_size)], sizes.repeats),
             "lmfs one at a time": (lambda: lambda p: [s.logprob for s in score_continuations_one_at_a_time(
                                  model, tokenizer, p)], 1)}
    if hf:
        peers["lm-eval HF"] = (lambda: lm_eval_scorer(model, tokenizer, device, sizes.batch_size), sizes.repeats)
    reference = None
    for name, (make, repeats) in peers.items():
        try:
            score = make()
            if cuda:
                score(pairs[:2 * sizes.batch_size])          # warm-up: kernels, allocator, HF's first call
            seconds, logprobs = _timed(lambda: score(pairs), device, repeats)
            if name == "lmfs one at a time":
                reference = logprobs
            row = {"seconds": seconds, "tokens_per_s": n_tokens / seconds, "logprobs": logprobs}
        except Exception as err:  # one failing peer (a missing package, a refusal) must not cost the others
            row = {"error": error_line(err)}
        result["rows"][name] = row
        print(f"  scored with {name}", flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for row in result["rows"].values():
        logprobs = row.pop("logprobs", None)
        if logprobs is not None and reference is not None:
            row["max_abs_diff"] = max(abs(a - b) for a, b in zip(logprobs, reference))
    result["ratios"] = _ratios(result["rows"])
    _print(result)
    return result


def _ratios(rows: dict) -> dict:
    ok = {name: row for name, row in rows.items() if "error" not in row}
    ratios = {}
    if "lmfs batched" in ok:
        for peer in ("lmfs one at a time", "lm-eval HF"):
            if peer in ok:
                ratios[f"lmfs batched / {peer}"] = ok["lmfs batched"]["tokens_per_s"] / ok[peer]["tokens_per_s"]
    return ratios


def _print(result: dict) -> None:
    import pandas as pd

    s = result["sizes"]
    print(f"\nmultiple-choice log-likelihood, {result['dtype']} on {result['device']}: "
          f"{result['params'] / 1e6:.1f} M parameters (d_model {s['d_model']}, {s['n_layers']} layers), "
          f"{s['items']} story-fact items x 4 choices, {s['shots']}-shot, {result['tokens']:,} tokens, "
          f"batch {s['batch_size']}")
    rows = []
    for name, r in result["rows"].items():
        if "error" in r:
            rows.append({"scorer": name, "s": "-", "tokens/s": "-", "max |Δ| vs one at a time": r["error"]})
        else:
            diff = r.get("max_abs_diff")
            rows.append({"scorer": name, "s": f"{r['seconds']:.3g}", "tokens/s": f"{r['tokens_per_s']:,.0f}",
                         "max |Δ| vs one at a time": "-" if diff is None else f"{diff:.1e}"})
    print(pd.DataFrame(rows).to_string(index=False))
    for name, value in result["ratios"].items():
        print(f"  {name}: {value:.3g}x")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="multiple-choice log-likelihood scoring: lmfs batched vs one at a "
                                                 "time vs lm-eval's Hugging Face backend, tokens/s")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--tiny", action="store_true", help="the CPU sizes, also on a GPU")
    parser.add_argument("--items", type=int, default=None, help="multiple-choice items (default 500 GPU, 40 CPU)")
    parser.add_argument("--no-hf", action="store_true", help="leave out lm-eval's Hugging Face backend")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = CPU_SIZES if args.tiny or device.type != "cuda" else GPU_SIZES
    if args.items is not None:
        sizes = Sizes(**{**asdict(sizes), "items": args.items})
    result = run(sizes, device, hf=not args.no_hf)
    save_json(result, args.json)
    return result

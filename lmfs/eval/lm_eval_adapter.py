"""Evaluating an lmfs model with EleutherAI's ``lm-eval`` harness, on tasks stored on disk.

``lm-eval`` talks to a model through three requests, all in text:

* ``loglikelihood(context, continuation)`` -> ``(log p(continuation | context), is_greedy)``;
* ``loglikelihood_rolling(text)`` -> ``log p(text)``, every token scored (perplexity tasks);
* ``generate_until(context, {"until": [...], "max_gen_toks": n, ...})`` -> the generated text.

:class:`LmfsLM` answers them with :mod:`lmfs.eval`'s own batched scorer and generation, so
``lm-eval`` and :func:`lmfs.eval.evaluate_multiple_choice` put the same numbers on the same items
(a test checks it). :func:`mc_task_config` describes a multiple-choice task whose items are a
local JSON-lines file (``context``, ``choices``, ``answer``: what :func:`lmfs.eval.write_jsonl`
writes), and :func:`run_lm_eval` runs ``lm-eval``'s evaluator on it in this process, offline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

try:
    from lm_eval.api.model import LM
except ImportError as err:   # a clear message instead of a bare ModuleNotFoundError deep in a notebook
    raise ImportError("lmfs.eval.lm_eval_adapter needs EleutherAI's harness: pip install lm-eval") from err

from lmfs.eval.harness import generate, score_continuations
from lmfs.eval.perplexity import text_perplexity


class LmfsLM(LM):
    """An ``lm_eval.api.model.LM`` backed by an lmfs ``model`` and ``tokenizer``.

    ``batch_size``: sequences per forward when scoring; ``max_gen_toks``: the default generation
    length when a task does not give one. Generation is greedy unless a task asks for
    ``do_sample`` with a ``temperature``.
    """

    def __init__(self, model, tokenizer, batch_size: int = 64, max_gen_toks: int = 64):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [tuple(r.args) for r in requests]
        return [(s.logprob, s.greedy) for s in score_continuations(self.model, self.tokenizer, pairs, self.batch_size)]

    def loglikelihood_rolling(self, requests) -> list[float]:
        # Each document on its own, every token scored (<|endoftext|> in front), windows of full context.
        return [-text_perplexity(self.model, self.tokenizer, r.args[0], batch_size=self.batch_size).nll
                for r in requests]

    def generate_until(self, requests) -> list[str]:
        out = []
        for r in requests:      # one call per request: each may bring its own stop strings and length
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            max_tokens = min(int(kwargs.get("max_gen_toks", self.max_gen_toks)), self.model.config.context_length - 1)
            text = generate(self.model, self.tokenizer, [context], max_tokens=max_tokens, temperature=temperature,
                            stop=tuple(u for u in until if u))[0][0]
            out.append(text)
        return out


def mc_task_config(name: str, jsonl_path: str | os.PathLike, num_fewshot: int = 0) -> dict:
    """An ``lm-eval`` multiple-choice task over a local JSON-lines file of MCItem fields.

    The formats match :func:`lmfs.eval.evaluate_multiple_choice`: the context as written, each
    choice after one space, few-shot examples separated by blank lines. Metrics: ``acc`` (raw
    sum), ``acc_norm`` (per character) and ``acc_bytes`` (per UTF-8 byte).
    """
    path = Path(jsonl_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: write the items with lmfs.eval.write_jsonl first")
    return dict(
        task=name, dataset_path="json", dataset_kwargs={"data_files": {"test": str(path)}},
        test_split="test", fewshot_split="test", output_type="multiple_choice",
        doc_to_text="context", doc_to_choice="choices", doc_to_target="answer",
        target_delimiter=" ", fewshot_delimiter="\n\n", num_fewshot=num_fewshot,
        metric_list=[dict(metric=m, aggregation="mean", higher_is_better=True)
                     for m in ("acc", "acc_norm", "acc_bytes")],
        metadata=dict(version=1.0),
    )


def run_lm_eval(model, tokenizer, tasks: Sequence[dict], num_fewshot: int | None = None, limit: int | None = None,
                batch_size: int = 64, log_samples: bool = False) -> dict:
    """Run ``lm-eval``'s ``simple_evaluate`` on task configs (e.g. :func:`mc_task_config`), here and offline.

    Returns ``lm-eval``'s result dictionary; its ``"results"`` entry maps each task to metrics
    named like ``"acc,none"`` and ``"acc_stderr,none"``.
    """
    # The data are local files: tell Hugging Face libraries not to look for anything online.
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Without the built-in task index (thousands of YAML files): only the configs given here.
    manager = TaskManager(include_defaults=False)
    return simple_evaluate(model=LmfsLM(model, tokenizer, batch_size=batch_size), tasks=list(tasks),
                           task_manager=manager,
                           num_fewshot=num_fewshot, limit=limit, bootstrap_iters=0, log_samples=log_samples,
                           verbosity="ERROR")

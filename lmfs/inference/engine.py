"""A continuous-batching inference engine over a paged KV cache.

:class:`LLM` serves many requests at once, the way vLLM does, with three parts:

* a :class:`~lmfs.inference.Scheduler` (plain Python) picks each step: a prefill of newly
  admitted requests or a decode step of the running ones, and hands out KV blocks of the
  :class:`~lmfs.inference.PagedKVCache` (prefix blocks shared, preemption by recompute);
* a model runner runs the step on the device and hands back the sampled tokens: by default
  :class:`~lmfs.inference.ModelRunner` (:func:`~lmfs.inference.paged_forward` and
  :func:`~lmfs.inference.sample`); :func:`lmfs.fast.fast_engine` hands in one that replays CUDA
  graphs and keeps steps in flight, for the same tokens faster;
* the loop ``schedule → runner.step → scheduler.accept`` (:meth:`LLM._run`), behind the public
  :meth:`LLM.generate`, :meth:`LLM.stream` and :meth:`LLM.start`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from lmfs.inference.kv_cache import PagedKVCache, kv_bytes_per_token
from lmfs.inference.runner import ModelRunner
from lmfs.inference.sampling import SamplingParams
from lmfs.inference.scheduler import Event, Request, RequestOutput, Scheduler, as_token_lists, params_list

FAST_OPTIONS = ("cuda_graphs", "attention", "fused_decode", "overlap", "in_flight")


class LLM:
    """Continuous-batching generation with a paged KV cache (module docstring).

    ``model``: a :class:`~lmfs.nn.TransformerLM` (any variant; kept in its mode, on its device and
    dtype); ``tokenizer``: anything with ``encode``/``decode`` (needed for text prompts, ``text``
    and stop strings); ``block_size``: tokens per KV block; ``kv_cache_tokens``: the KV budget in
    tokens (default: room for ``max_batch_size`` full contexts, capped on a GPU at half its free
    memory, on the CPU at 16 full contexts); ``max_batch_size``: running requests at most;
    ``max_batch_tokens``: prompt tokens per prefill step (a longer prompt runs alone); ``progress``:
    a progress bar over requests (None: only on a terminal or notebook); ``autocast``: None
    (compute in the weights' dtype) or a 16-bit dtype every forward runs in (the KV cache holds it;
    sampling stays in float32); ``runner``: the model runner (None: :class:`ModelRunner`).

    ``forward_hook``: None, or ``hook(kind, real_rows, computed_rows)`` returning a context manager
    that the runner enters around each forward it launches (``kind`` ``"prefill"`` or
    ``"decode"``; ``computed_rows`` counts padding too), e.g. to time the forwards.

    ``stats`` (after each call): prefill/decode tokens, seconds and steps, preemptions, prompt
    tokens served from shared prefix blocks, the peak number of KV blocks in use, and KV bytes in
    use vs bytes of the tokens cached, summed over decode steps (``kv_memory_ratio``, their ratio).
    Tokens of a shared block count once per request using it. A sliding-window model keeps the
    blocks that have left its window (simple, not minimal). A fast runner adds how decode ran
    (:class:`lmfs.fast.FastRunner`): ``cuda_graphs``, ``fused_decode``, ``overlapped_steps``,
    ``decode_wait_seconds`` and ``decode_device_seconds``.
    """

    def __init__(self, model, tokenizer=None, block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_batch_size: int = 256, max_batch_tokens: int = 4096, progress: bool | None = None,
                 autocast: torch.dtype | None = None, runner=None, **fast_options):
        unknown = sorted(set(fast_options) - set(FAST_OPTIONS))
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown}")
        if fast_options:
            raise TypeError(f"{sorted(fast_options)} are options of the fast runner: use "
                            "lmfs.fast.fast_engine(model, ...) or LLM(model, runner=lmfs.fast.FastRunner(model, ...))")
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast={autocast!r}: use None (the weights' dtype) or torch.bfloat16 / torch.float16")
        param = next(model.parameters())
        self.model, self.tokenizer, self.config, self.progress = model, tokenizer, model.config, progress
        self.autocast = autocast
        self.device, self.dtype = param.device, autocast or param.dtype   # the dtype of the forwards and the cache
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_batch_size={max_batch_size} and max_batch_tokens={max_batch_tokens} "
                             "must be positive")
        if kv_cache_tokens is None:
            kv_cache_tokens = self._default_kv_tokens(max_batch_size)
        self.cache = PagedKVCache.for_model(model, kv_cache_tokens, block_size, dtype=self.dtype)
        self.allocator = self.cache.allocator
        self.scheduler = Scheduler(self.allocator, block_size, max_batch_size, max_batch_tokens,
                                   model.config.context_length, tokenizer)
        self.runner = ModelRunner() if runner is None else runner
        self.runner.bind(model, self.cache, max_batch_size, autocast)
        self.forward_hook: Callable | None = None
        self._started: Generation | None = None  # a start() whose result() has not been taken
        self.stats = self._empty_stats()

    def _default_kv_tokens(self, max_batch_size: int) -> int:
        ctx = self.config.context_length
        want = max_batch_size * ctx
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(min(want, int(0.5 * free) // kv_bytes_per_token(self.config, self.dtype)), ctx)
        return min(want, 16 * ctx)

    @staticmethod
    def _empty_stats() -> dict:
        return dict(requests=0, prefill_tokens=0, prefill_seconds=0.0, prefill_steps=0, decode_tokens=0,
                    decode_seconds=0.0, decode_steps=0, preemptions=0, shared_prefix_tokens=0,
                    peak_kv_blocks=0, kv_bytes_in_use=0, kv_bytes_of_tokens=0, kv_memory_ratio=None,
                    cuda_graphs=False, fused_decode=False, overlapped_steps=0, decode_wait_seconds=0.0,
                    decode_device_seconds=None)

    @property
    def step_in_flight(self) -> bool:
        """Whether a step runs on the device whose tokens the host has not read yet: host work done
        now (in an ``on_finish`` callback, say) hides behind it."""
        return self.scheduler.unread > 0

    # ------------------------------------------------------------------------------------------
    # Public API

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings, with a tokenizer, or lists of token ids); ``params``:
        one :class:`SamplingParams` for all or one per prompt. Returns one :class:`RequestOutput`
        per prompt, in order. A bad request (empty, too long, never fits the KV budget) gets
        ``finish_reason="error"`` and the others go on.

        ``on_finish(output)``, if given, is called once per request with its output as soon as it
        finishes (a refused request's first), in the order they finish: with a runner that keeps
        steps in flight, while the next step runs on the device. The same objects are returned."""
        return self.start(prompts, params, progress, on_finish).result()

    def start(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
              progress: bool | None = None,
              on_finish: Callable[[RequestOutput], None] | None = None) -> "Generation":
        """:meth:`generate` in two halves. This half checks the requests, admits the first ones and
        launches their prefill, then returns; the returned :class:`Generation`'s ``result()`` does
        the rest. In between the host is free (a trainer queues its optimizer step while the
        prefill runs). Until ``result()`` (or ``close()``) the engine runs nothing else."""
        if self._started is not None:
            raise RuntimeError("the engine is still running an earlier start(): call its result() (or close()) "
                               "first")
        requests = self._requests(prompts, params)
        generation = Generation(self, requests, on_finish)
        for r in requests:
            if r.finish_reason is not None:
                generation._finish(r)
        generation._steps = self._run(requests, progress, events=False)
        self._started = generation
        try:
            generation._advance()   # the first admission and prefill
        except BaseException:
            generation.close()
            raise
        return generation

    def stream(self, prompts, params=None, progress: bool | None = False) -> Iterator[tuple[int, int, str]]:
        """Like :meth:`generate`, yielding ``(request index, token id, text piece)`` as each token is
        produced (the text piece is ``""`` without a tokenizer, or while a character is incomplete)."""
        if self._started is not None:
            raise RuntimeError("the engine is still running a start(): call its result() (or close()) first")
        for events in self._run(self._requests(prompts, params), progress):
            for req, token, piece in events:
                yield req.index, token, piece

    # ------------------------------------------------------------------------------------------

    def _requests(self, prompts, params) -> list[Request]:
        token_lists = as_token_lists(prompts, self.tokenizer)
        params = params_list(params, len(token_lists))
        if self.tokenizer is None and any(sp.stop for sp in params):
            raise ValueError("stop strings need a tokenizer to see the text: pass tokenizer=... to LLM, "
                             "or stop on token ids (SamplingParams(stop_token_ids=...))")
        requests = [Request(i, p, sp, self.device) for i, (p, sp) in enumerate(zip(token_lists, params))]
        for r in requests:
            r.error = self._problem(r)
            if r.error:
                r.finish_reason = "error"
        return requests

    def _problem(self, r: Request) -> str | None:
        """Why request ``r`` cannot run, or None."""
        ctx, V = self.config.context_length, self.config.vocab_size
        n = len(r.prompt)
        if n == 0:
            return "empty prompt: give at least one token"
        if n >= ctx:
            return (f"prompt of {n} tokens leaves no room in the model's context_length={ctx}: "
                    f"shorten it to at most {ctx - 1} tokens")
        if min(r.prompt) < 0 or max(r.prompt) >= V:
            return f"prompt holds token ids outside the vocabulary 0..{V - 1}"
        need = self.scheduler.blocks_needed(r)
        if need > self.allocator.usable:
            return (f"needs {need} KV blocks of {self.cache.block_size} tokens but the cache has "
                    f"{self.allocator.usable}: raise kv_cache_tokens or lower max_tokens")
        return None

    def _run(self, requests: list[Request], progress, events: bool = True) -> Iterator[list[Event]]:
        """The loop: schedule a step, run it, accept the tokens handed back, until every request is
        finished. Yields each step's events (``(request, token, text piece)``; with ``events=False``
        empty lists, for a consumer that reads only ``scheduler.finished``)."""
        from tqdm.auto import tqdm
        self.stats = s = self._empty_stats()
        s["requests"] = len(requests)
        scheduler, runner = self.scheduler, self.runner
        scheduler.begin(s, events)
        runner.begin(s)
        progress = self.progress if progress is None else progress
        bar = tqdm(total=len(requests), desc="requests", disable=None if progress is None else not progress)
        bar.update(sum(r.finish_reason is not None for r in requests))
        scheduler.add(requests)
        try:
            while scheduler.busy:
                batch = scheduler.schedule()
                start = time.perf_counter()
                new = []
                for reqs, ids, lps, prefill in runner.step(batch, self.forward_hook):
                    new += scheduler.accept(reqs, ids, lps)
                    if not prefill:
                        s["decode_tokens"] += scheduler.accepted
                s["prefill_seconds" if batch.prefill else "decode_seconds"] += time.perf_counter() - start
                yield new
                bar.update(len(scheduler.finished))
                scheduler.finished.clear()
        finally:
            bar.close()
            runner.end(s)
            scheduler.abort(requests)   # a consumer that stops early leaves no blocks behind
            s["kv_bytes_in_use"] = s.pop("kv_blocks_in_use") * self.cache.block_bytes
            s["kv_bytes_of_tokens"] = self.cache.bytes_of_tokens(s.pop("kv_tokens_cached"))
            # time-averaged KV memory in use per byte of cached tokens (>= 1)
            s["kv_memory_ratio"] = s["kv_bytes_in_use"] / s["kv_bytes_of_tokens"] if s["kv_bytes_of_tokens"] else None


class Generation:
    """A :meth:`LLM.start` under way: ``result()`` runs it to the end and returns one
    :class:`RequestOutput` per prompt, in order; ``close()`` abandons it (its requests' KV blocks
    and rows are freed)."""

    def __init__(self, llm: LLM, requests: list, on_finish: Callable[[RequestOutput], None] | None):
        self._llm, self._on_finish = llm, on_finish
        self._outputs: list[RequestOutput | None] = [None] * len(requests)
        self._steps: Iterator | None = None
        self.done = False

    def _finish(self, r: Request) -> None:
        self._outputs[r.index] = out = r.output(self._llm.tokenizer)
        if self._on_finish is not None:
            self._on_finish(out)

    def _advance(self) -> bool:
        """One step of the loop; False once every request has finished."""
        llm = self._llm
        try:
            next(self._steps)
        except StopIteration:
            self.done = True
            llm._started = None
            return False
        for r in llm.scheduler.finished:   # every request that runs finishes in accept(), which lists it
            self._finish(r)
        return True

    def result(self) -> list[RequestOutput]:
        if self._llm._started is not self and not self.done:
            raise RuntimeError("this generation was closed before it finished")
        try:
            while not self.done and self._advance():
                pass
        except BaseException:
            self.close()
            raise
        return self._outputs

    def close(self) -> None:
        if self._steps is not None:
            self._steps.close()      # the loop's clean-up frees what its requests hold
        if self._llm._started is self:
            self._llm._started = None

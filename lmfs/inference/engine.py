"""A continuous-batching inference engine over a paged KV cache, and the static-batching baseline.

:class:`LLM` serves many requests at once, the way vLLM does:

* **Scheduler.** Each step is either a *prefill* (waiting requests are admitted, first come first
  served, while KV blocks, batch rows and the step's token budget allow; their prompts run packed
  into one row) or a *decode* (every running request advances one token, all in one forward).
  A finished request frees its blocks at once and the next step can admit another: batches never
  wait for their slowest member, which is what static batching (:func:`generate_static`) does.
* **Paged KV cache** (:class:`~lmfs.inference.PagedKVCache`): blocks of ``block_size`` tokens,
  handed out one at a time, shared between requests whose prompts start with the same full
  blocks. When a decode step needs a block and none is free, the most recently admitted request
  is *preempted*: its blocks are freed and it goes back to the front of the queue with the tokens
  it generated, to be recomputed later (so every request finishes; a seeded request keeps its
  generator, so its output does not change).
* **Decode without host work per token.** Block tables, positions and last tokens live in device
  tensors indexed by a per-request row; a decode step gathers them with the running rows' indices,
  samples on the device (greedy and temperature-only requests, the common case; top-k/p, min-p
  and repetition penalties go through :func:`~lmfs.inference.sample` after the forward), advances
  the positions and last tokens there too, and copies one small ``(2, B)`` tensor of ids and
  log-probs to the host. What the host does per step is bookkeeping of Python lists (new blocks,
  finished requests), never a loop over the vocabulary.
* **Overlap** (``overlap=True``). Since step ``n + 1`` needs nothing from the host that step ``n``
  produced (its tokens and positions are already on the device), the engine launches step ``n + 1``
  *before* it reads step ``n``'s tokens: the ids travel to pinned host memory while the device
  computes, and the host's bookkeeping of step ``n`` runs during step ``n + 1``. It keeps
  ``in_flight`` steps launched ahead (2 by default): with one, the host must read a step and launch
  the next within one step's device time, and a host that takes about as long as the device (a
  small model's decode step on a GPU) lets the device run dry whenever it is late; with two, a late
  step is made up by the next. The price: a request that stops on a stop token (or string) at step
  ``n`` has already been fed to the steps launched after it; those extra tokens are dropped (their
  keys went to the request's own blocks, freed once the last such step is read). A request ending
  by length is known ahead and sits those steps out. A prefill of plain requests
  (temperature only) is treated the same way: its first tokens are drawn on the device, and read
  with the first decode step, which is launched before them. Anything that needs every
  token on the host first waits for the steps in flight: admitting requests (prefill), preempting,
  repetition penalties (they read the tokens so far) and MLA (whose decode batches are built on
  the host). :meth:`LLM.start` goes one step further: it returns once the first prefill is
  launched, so the host can work while the device is still busy with what was queued before it.
* **CUDA graphs** (GPU): the whole decode step, forward and sampling, is captured once per padded
  batch size (1, 2, 4, then steps of 8 or 16: :func:`graph_batch_size`; padded rows read and write
  a dummy row and the scratch block) and replayed, so a step costs one launch instead of a
  thousand. Batches of greedy requests only have graphs of their own, whose bookkeeping (gathering
  the batch; argmax, log-prob and advance) is two kernels (:mod:`lmfs.kernels.engine_step`) instead
  of about twenty small PyTorch ones (about an eighth of a batch-1 token's time on an H200). A
  step that cannot be captured decodes without graphs, with a warning. If the weights' storage
  changes between calls (a new dtype, new tensors), the graphs are captured again; weights updated
  in place (an optimiser step) are read by the next replay as they are.
* **Fused forward** (``fused_decode``): decode steps and prefills may run
  :class:`lmfs.kernels.decode.FusedDecode`, the same forward with the q/k/v and gate/up
  projections merged into one matmul each and about ten kernels a layer (prefill attends over the
  keys it gathers from the cache, :func:`~lmfs.inference.runner.gathered_attention`; batch-1
  decode steps take its six-kernel GEMV path). On a GPU a prefill of a few thousand tokens written
  op by op spends longer launching its ~750 kernels than running them.
* **Autocast** (``autocast=torch.bfloat16``): every forward (prefill and decode step, fused or
  not, in a CUDA graph or not) runs under ``torch.autocast``, as a training step under autocast
  does, and the KV cache holds that dtype; sampling stays in float32. The weights stay as they
  are (float32 master weights of a model being trained): each matmul reads its weight through
  an autocast cast. Those casts run inside the step, so a CUDA graph captures them and each
  replay casts the weights as they are then (an optimizer step in place is seen); the cast cache
  is off, so no cast outlives its forward. The fused forward instead holds its projection
  weights in the autocast dtype (``FusedDecode(dtype=...)``): copies that each ``generate`` call
  brings up to date before its first step, copying only the parameters updated in place since the
  call before (their version counters tell), so a step casts no projection weight (only the
  small head's), and the copies round as the casts would. (A replayed CUDA graph reads the copies
  as they are, so with graphs an update made while a ``stream`` is being consumed reaches the next
  call, not the rest of that one.) Its Triton kernels read the 16-bit activations and write the
  16-bit cache. Why: a float32 weight makes every projection of the decode step a float32 matmul,
  several times slower than a bfloat16 one on a GPU, and a trainer whose update computes in
  bfloat16 wants its rollouts' log-probs from the same numerics.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lmfs.inference.kv_cache import (BlockAllocator, KVCache, PagedKVCache, kv_bytes_per_token,
                                     paged_attention_reference)
from lmfs.inference.runner import PagedBatch, capture_graph, forward_cached, gathered_batch, paged_forward, upload
from lmfs.inference.sampling import SamplingParams, draw_uniforms, sample, sample_scaled


@dataclass
class RequestOutput:
    """The result of one request: generated ``token_ids``, their ``logprobs`` (None if not asked
    for), the decoded ``text`` (None without a tokenizer), ``finish_reason`` ``"stop"`` (a stop token
    or string), ``"length"`` (``max_tokens`` or the context is full) or ``"error"`` (then ``error``
    says why and nothing was generated)."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    error: str | None = None


class _Request:
    """Engine-side state of one request."""

    def __init__(self, index: int, prompt: list[int], params: SamplingParams, device):
        self.index, self.prompt, self.params = index, prompt, params
        self.generator = params.generator(device)
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text = ""                # decoded output so far (with a tokenizer)
        self.sent = 0                 # characters of `text` already streamed
        self.row: int | None = None   # row in the engine's device state while running
        self.blocks: list[int] = []
        self.end = 0                  # the length at which it ends by length (set by the engine)
        self.max_out = 0              # output tokens at which it ends by length: end - len(prompt)
        self.stop_ids = params.stop_token_ids
        self.watch_text = bool(params.stop)   # stop strings: every token may end it
        self.device_len = 0           # its length on the device: the tokens read so far plus those in flight

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def length(self) -> int:
        """``len(tokens)``, without building the list (the decode loop asks for it every step)."""
        return len(self.prompt) + len(self.out)

    def output(self, tokenizer) -> RequestOutput:
        text = None
        if tokenizer is not None and self.error is None:
            text = self.text if self.params.stop else tokenizer.decode(self.out)
        # the request's own lists, not copies: it is finished, and nothing appends to them any more
        return RequestOutput(self.index, self.prompt, self.out, text,
                             self.logprobs if self.params.logprobs and self.error is None else None,
                             self.finish_reason, self.error)


# what a step hands the stream per new token: its request, the token, the text it makes decodable
_Event = tuple[_Request, int, str]


def _as_token_lists(prompts, tokenizer) -> list:
    if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("prompts must be a list of prompts (strings or lists of token ids), "
                        "e.g. [prompt] for a single one")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise TypeError("text prompts need a tokenizer: pass tokenizer=... or token id lists")
            p = tokenizer.encode(p)
        out.append(list(map(int, p)))     # (a comprehension calling int takes twice as long)
    return out


def _params_list(params, n: int) -> list[SamplingParams]:
    params = SamplingParams() if params is None else params
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    return params


def _settings(reqs: list[_Request]) -> tuple:
    """The requests' sampling settings: their params, temperatures, generators (None when none is
    seeded: draw_uniforms then skips its loop) and the distinct params (often one object for all)."""
    first = reqs[0].params if reqs else None
    if reqs and first.seed is None and all(r.params is first for r in reqs):
        n = len(reqs)    # the common case, one unseeded params object for all: no loop over the requests
        return [first] * n, [first.temperature] * n, None, (first,)
    params = [r.params for r in reqs]
    generators = [r.generator for r in reqs]
    if all(g is None for g in generators):
        generators = None
    return params, [p.temperature for p in params], generators, {id(p): p for p in params}.values()


def _finish(req: _Request, context_length: int, tokenizer) -> None:
    """Set ``req.finish_reason`` if its last token ends it: a stop token, a stop string (the text is
    cut before it), ``max_tokens``, or a full context (prompt + output = ``context_length``)."""
    p = req.params
    if tokenizer is not None and p.stop:
        req.text = tokenizer.decode(req.out)
        cuts = [i for i in (req.text.find(s) for s in p.stop) if i >= 0]
        if cuts:
            req.text, req.finish_reason = req.text[:min(cuts)], "stop"
            return
    if req.out[-1] in p.stop_token_ids:
        req.finish_reason = "stop"
    elif len(req.out) >= p.max_tokens or len(req.prompt) + len(req.out) >= context_length:
        req.finish_reason = "length"


def _text_piece(req: _Request, tokenizer) -> str:
    """The newly decodable text of ``req``'s output (held back while it ends mid-character)."""
    if tokenizer is None:
        return ""
    if not req.params.stop:
        req.text = tokenizer.decode(req.out)
    text = req.text
    end = len(text) if req.finish_reason or not text.endswith("\ufffd") else len(text.rstrip("\ufffd"))
    piece, req.sent = text[req.sent:end], max(req.sent, end)
    return piece


class LLM:
    """Continuous-batching generation with a paged KV cache (module docstring).

    ``model``: a :class:`~lmfs.nn.TransformerLM` (any variant; kept in its mode, on its device and
    dtype); ``tokenizer``: anything with ``encode``/``decode`` (needed for text prompts, ``text``
    and stop strings); ``block_size``: tokens per KV block; ``kv_cache_tokens``: the KV budget in
    tokens (default: room for ``max_batch_size`` full contexts, capped on a GPU at half its free
    memory, on the CPU at 16 full contexts); ``max_batch_size``: running requests at most;
    ``max_batch_tokens``: prompt tokens per prefill step (a longer prompt runs alone);
    ``cuda_graphs``: ``"auto"`` (on for CUDA, off on the CPU), True or False; ``attention``:
    decode attention, ``"auto"`` (the Triton kernel on CUDA when importable and the model has no
    sliding window or soft-cap, else the reference), ``"triton"`` or ``"reference"``;
    ``fused_decode``: ``"auto"`` (:class:`lmfs.kernels.decode.FusedDecode` for decode steps and prefills on
    CUDA when it supports the model), True (required; also on the CPU, where its Triton kernels
    run in the interpreter) or False (:func:`~lmfs.inference.paged_forward`); ``overlap``: launch
    decode steps before reading the tokens of those before (module docstring; False waits for
    every step, which gives the same outputs), keeping up to ``in_flight`` steps launched whose
    tokens are not read yet; ``progress``: a progress bar over requests (None:
    only on a terminal or notebook); ``autocast``: None (compute in the weights' dtype) or a 16-bit
    dtype to run the forwards in (module docstring, "Autocast").

    ``stats`` (after each call): prefill/decode tokens, seconds and steps, preemptions, prompt
    tokens served from shared prefix blocks, the peak number of KV blocks in use, and KV bytes in
    use vs bytes of the tokens cached, summed over decode steps (``kv_memory_ratio``, their ratio).
    Tokens of a shared block count once per request using it. A sliding-window model keeps the
    blocks that have left its window (simple, not minimal). How decode ran: ``cuda_graphs`` and
    ``fused_decode`` (whether its steps replayed CUDA graphs, ran the fused forward),
    ``overlapped_steps`` (steps launched while an earlier one was still in flight),
    ``decode_wait_seconds`` (host time spent waiting for a step's tokens: the rest of
    ``decode_seconds`` is host work) and, on CUDA, ``decode_device_seconds`` (device time of the
    steps, from CUDA events). ``decode_steps`` counts steps launched, ``decode_tokens`` tokens kept.
    """

    def __init__(self, model, tokenizer=None, block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_batch_size: int = 256, max_batch_tokens: int = 4096, cuda_graphs="auto",
                 attention: str = "auto", fused_decode="auto", overlap: bool = True,
                 in_flight: int = 2, progress: bool | None = None, autocast: torch.dtype | None = None):
        cfg = model.config
        param = next(model.parameters())
        self.model, self.tokenizer, self.config = model, tokenizer, cfg
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast={autocast!r}: use None (the weights' dtype) or torch.bfloat16 / torch.float16")
        self.autocast = autocast
        # the dtype the forwards compute in, and so the KV cache's
        self.device, self.dtype = param.device, autocast or param.dtype
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_batch_size={max_batch_size} and max_batch_tokens={max_batch_tokens} "
                             "must be positive")
        self.block_size, self.max_batch_size, self.max_batch_tokens = block_size, max_batch_size, max_batch_tokens
        if in_flight < 1:
            raise ValueError(f"in_flight={in_flight}: keep at least one decode step in flight (overlap=False "
                             "waits for every step)")
        self.progress, self.overlap, self.in_flight = progress, bool(overlap), in_flight
        if kv_cache_tokens is None:
            kv_cache_tokens = self._default_kv_tokens()
        self.cache = PagedKVCache.for_model(model, kv_cache_tokens, block_size, dtype=self.dtype)
        self.allocator: BlockAllocator = self.cache.allocator
        self.max_blocks = math.ceil(cfg.context_length / block_size)

        # Device state, one row per running request plus a last, dummy row that padded batch rows
        # point to: its block table is all zeros (the scratch block) and its position 0.
        R = max_batch_size + 1
        self.dummy = max_batch_size
        self.tables = torch.zeros(R, self.max_blocks, dtype=torch.int32, device=self.device)
        self.positions = torch.zeros(R, dtype=torch.long, device=self.device)
        self.last_token = torch.zeros(R, dtype=torch.long, device=self.device)
        self.free_rows = list(range(max_batch_size - 1, -1, -1))

        self.decode_attention = self._pick_attention(attention)
        self.cuda_graphs = self._pick_graphs(cuda_graphs)
        self._fused = self._pick_fused(fused_decode)   # built once: it merges the projections' weights
        self._step_kernels = self._pick_step_kernels()
        self._forward = paged_forward if self._fused is None else self._fused
        self._graphs: dict[tuple[int, bool], tuple] = {}   # (batch size, all greedy) -> captured step
        self._filled: dict[tuple[int, bool], dict] = {}    # the batch state each graph's input buffers hold
        self._graph_pool = None
        self._weights = self._weight_addresses()   # where the weights lived when the graphs were captured
        self._state = None                    # the decode batch's device tensors (_batch_state)
        self._pending: deque[_Step] = deque()  # the steps in flight, oldest first, their tokens not read yet
        # On CUDA, the pinned host buffers the steps' tokens (_pack: at most max_batch_size of each) are
        # copied into, used in turn: at most in_flight + 1 steps are unread at once, so a buffer is read
        # before its turn comes again
        self._host_buffers = [torch.empty(2 * max_batch_size, dtype=torch.float64, pin_memory=True)
                              for _ in range(in_flight + 2)] if self.device.type == "cuda" else []
        self._host_turn = 0
        self._started: Generation | None = None  # a start() whose result() has not been taken
        self._finished: list[_Request] = []   # finished at this step (_accept appends, _run clears)
        self._events, self._accepted = True, 0  # whether _accept lists its tokens; how many it took
        self.stats = self._empty_stats()

    # ------------------------------------------------------------------------------------------
    # Set-up

    def _default_kv_tokens(self) -> int:
        cfg = self.config
        want = self.max_batch_size * cfg.context_length
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            per_token = kv_bytes_per_token(cfg, self.dtype)
            return max(min(want, int(0.5 * free) // per_token), cfg.context_length)
        return min(want, 16 * cfg.context_length)

    def _pick_attention(self, attention: str):
        cfg = self.config
        plain = cfg.attention != "mla" and cfg.window is None and cfg.attn_softcap is None
        if attention == "reference":
            return paged_attention_reference
        if attention not in ("auto", "triton"):
            raise ValueError(f"attention={attention!r}: use 'auto', 'triton' or 'reference'")
        if attention == "triton" and not plain:
            raise ValueError("the Triton paged kernel handles plain attention only: this model uses MLA, "
                             "a sliding window or a soft-cap; use attention='reference'")
        try:
            from lmfs.kernels.paged_attention import paged_decode_attention
        except ImportError as err:
            if attention == "triton":
                raise ImportError(f"attention='triton' needs lmfs.kernels.paged_attention: {err}") from err
            return paged_attention_reference
        if attention == "auto" and not (plain and self.device.type == "cuda"):
            return paged_attention_reference
        return paged_decode_attention

    def _pick_graphs(self, cuda_graphs) -> bool:
        if cuda_graphs not in ("auto", True, False):
            raise ValueError(f"cuda_graphs={cuda_graphs!r}: use 'auto', True or False")
        capturable = self.config.attention != "mla" and self.config.moe_experts == 0
        if cuda_graphs is True and (self.device.type != "cuda" or not capturable):
            raise ValueError("cuda_graphs=True needs the model on a CUDA device, and a dense (no MoE, whose "
                             "routing syncs with the host) non-MLA model; use cuda_graphs='auto'")
        return cuda_graphs is not False and self.device.type == "cuda" and capturable

    def _pick_step_kernels(self):
        """:mod:`lmfs.kernels.engine_step` (the decode step's bookkeeping in two kernels) on a GPU, else None."""
        if self.device.type != "cuda":
            return None
        try:
            from lmfs.kernels import engine_step
        except ImportError:
            return None
        return engine_step

    def _pick_fused(self, fused_decode):
        """The fused forward (:class:`lmfs.kernels.decode.FusedDecode`, decode steps and prefills) for
        this model, or None."""
        if fused_decode not in ("auto", True, False):
            raise ValueError(f"fused_decode={fused_decode!r}: use 'auto', True or False")
        if fused_decode is False or (fused_decode == "auto" and self.device.type != "cuda"):
            return None
        try:
            from lmfs.kernels.decode import FusedDecode
        except ImportError as err:
            if fused_decode is True:
                raise ImportError(f"fused_decode=True needs lmfs.kernels.decode.FusedDecode, which does not "
                                  f"import ({err}); use fused_decode='auto' or False") from err
            return None
        reason = FusedDecode.supports(self.model)
        if reason is not None:
            if fused_decode is True:
                raise ValueError(f"fused_decode=True: the fused decode forward cannot run this model ({reason}); "
                                 "use fused_decode='auto' or False")
            return None
        return self._fused_forward(FusedDecode)

    def _fused_forward(self, cls):
        """``cls`` (:class:`~lmfs.kernels.decode.FusedDecode`) for the model as it is now, holding its
        weights in the autocast dtype where that differs from theirs (module docstring, "Autocast")."""
        dtype = next(self.model.parameters()).dtype
        return cls(self.model, dtype=self.autocast if self.autocast not in (None, dtype) else None)

    def _autocast(self):
        """The context every forward runs in: autocast to ``self.autocast`` (its cast cache off, so that
        each forward, and each replay of a captured one, casts the weights as they are now), or none."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast, cache_enabled=False)

    @property
    def step_in_flight(self) -> bool:
        """Whether a decode step runs on the device whose tokens the host has not read yet: host work
        done now (in an ``on_finish`` callback, say) hides behind it. False once the last answers
        of a :meth:`generate` are handed over, since nothing is left to compute then."""
        return bool(self._pending)

    @staticmethod
    def _empty_stats() -> dict:
        return dict(requests=0, prefill_tokens=0, prefill_seconds=0.0, prefill_steps=0, decode_tokens=0,
                    decode_seconds=0.0, decode_steps=0, preemptions=0, shared_prefix_tokens=0,
                    peak_kv_blocks=0, kv_bytes_in_use=0, kv_bytes_of_tokens=0, kv_memory_ratio=None,
                    cuda_graphs=False, fused_decode=False, overlapped_steps=0, decode_wait_seconds=0.0,
                    decode_device_seconds=None)

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
        finishes (a refused request's first), in the order they finish. With overlap on, that is
        while the next decode step runs on the device, so work done there (scoring an answer,
        decoding its text) hides behind the generation of the others instead of waiting for the
        last one. The same objects are returned."""
        return self.start(prompts, params, progress, on_finish).result()

    def start(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
              progress: bool | None = None,
              on_finish: Callable[[RequestOutput], None] | None = None) -> "Generation":
        """:meth:`generate` in two halves. This half checks the requests, admits the first ones and
        launches their prefill on the device, then returns without waiting for it; the returned
        :class:`Generation`'s ``result()`` does the rest and returns what :meth:`generate` would.
        In between the host is free: a trainer starts its next rollout right after queueing an
        optimizer step, and the host's work of admitting and prefilling (milliseconds) runs while
        the device still computes the update; the prefill, queued after it, reads the new weights.
        Until ``result()`` (or ``close()``) the engine runs nothing else."""
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
        requests = self._requests(prompts, params)
        for events in self._run(requests, progress):
            for req, token, piece in events:
                yield req.index, token, piece

    # ------------------------------------------------------------------------------------------
    # Requests and the scheduler

    def _requests(self, prompts, params) -> list[_Request]:
        token_lists = _as_token_lists(prompts, self.tokenizer)
        requests = [_Request(i, p, sp, self.device)
                    for i, (p, sp) in enumerate(zip(token_lists, _params_list(params, len(token_lists))))]
        ctx = self.config.context_length
        for r in requests:
            r.end = min(len(r.prompt) + r.params.max_tokens, ctx)
            r.max_out = r.end - len(r.prompt)
            r.error = self._problem(r)
            if r.error:
                r.finish_reason = "error"
        return requests

    def _problem(self, r: _Request) -> str | None:
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
        need = math.ceil(min(n + r.params.max_tokens, ctx) / self.block_size)
        if need > self.allocator.usable:
            return (f"needs {need} KV blocks of {self.block_size} tokens but the cache has "
                    f"{self.allocator.usable}: raise kv_cache_tokens or lower max_tokens")
        return None

    def _run(self, requests: list[_Request], progress, events: bool = True) -> Iterator[list[_Event]]:
        """Schedule until every request is finished, yielding the events (``_Event``) of each
        step's new tokens (one list a step: a rollout of 256 answers of 256 tokens is 65k tokens, and
        the host's time per token counts); with ``events=False`` empty lists, for a consumer that
        reads only ``self._finished``, the requests finished at that step (a tuple per token is
        the host's largest cost per token after the token itself)."""
        from tqdm.auto import tqdm
        self.stats = s = self._empty_stats()
        self._finished = []
        self._events = events
        if self.device.type == "cuda":
            s["decode_device_seconds"] = 0.0
        self._check_weights()
        self._state = None
        s["requests"] = len(requests)
        progress = self.progress if progress is None else progress
        bar = tqdm(total=len(requests), desc="requests", disable=None if progress is None else not progress)
        bar.update(sum(r.finish_reason is not None for r in requests))
        waiting = deque(r for r in requests if r.finish_reason is None)
        running: list[_Request] = []
        try:
            while waiting or running or self._pending:
                admitted = self._admit(waiting, running)
                start = time.perf_counter()
                if admitted:   # the prefill starts from known tokens: read the steps in flight first
                    events = self._drain(running)
                    s["decode_seconds"] += time.perf_counter() - start
                    events += self._prefill(admitted, running)
                else:
                    events = self._decode(waiting, running)
                    s["decode_seconds"] += time.perf_counter() - start
                yield events
                bar.update(len(self._finished))
                self._finished.clear()
        finally:
            bar.close()
            # time-averaged KV memory in use per byte of cached tokens (>= 1)
            s["kv_memory_ratio"] = s["kv_bytes_in_use"] / s["kv_bytes_of_tokens"] if s["kv_bytes_of_tokens"] else None
            s["fused_decode"] = self._fused is not None and s["decode_steps"] > 0
            steps, self._pending = self._pending, deque()
            for r in running + [r for step in steps for r in step.requests]:
                self._release(r)   # a consumer that stops early leaves no blocks behind

    def _admit(self, waiting: deque, running: list) -> list[_Request]:
        """Take waiting requests, first come first served, while rows, blocks and the prefill token
        budget allow; give each its blocks (sharing full prefix blocks already in the cache)."""
        admitted, tokens = [], 0
        bs, alloc = self.block_size, self.allocator
        # free rows, not max_batch_size - len(running): a request that stopped keeps its row until
        # the last step in flight that still holds it is read
        while waiting and self.free_rows:
            r = waiting[0]
            seq = r.tokens
            n = len(seq)
            if admitted and tokens + n > self.max_batch_tokens:
                break
            # Full blocks before the last token may be shared: the last token's logits are needed,
            # so at least that one is computed, and it never writes into a shared block.
            keys = BlockAllocator.prefix_hashes(seq, bs, n // bs)
            shared = []
            for key in keys[:(n - 1) // bs]:
                block = alloc.lookup(key)
                if block is None:
                    break
                shared.append(block)
            if alloc.num_free < math.ceil((n + 1) / bs) - len(shared):   # +1: room for the next token
                break
            waiting.popleft()
            r.blocks = [alloc.share(b) for b in shared]
            r.blocks += [alloc.allocate() for _ in range(math.ceil(n / bs) - len(shared))]
            for i in range(len(shared), len(keys)):
                alloc.register(r.blocks[i], keys[i])
            r.cached = len(shared) * bs        # tokens whose keys are already in the cache
            r.row = self.free_rows.pop()
            admitted.append(r)
            tokens += n - r.cached
        return admitted

    def _release(self, r: _Request) -> None:
        """Free ``r``'s blocks and row (nothing if it holds none)."""
        for b in r.blocks:
            self.allocator.release(b)
        r.blocks = []
        if r.row is not None:
            self.free_rows.append(r.row)
            r.row = None

    def _accept(self, reqs: list[_Request], ids: list[float], lps: list[float],
                running: list) -> list[_Event]:
        """Append each request's sampled token (``ids``, ``lps``: host lists, one entry per request),
        finish and free those that are done. A request that finished at an earlier step (it was
        fed to this one before its stop token was read) drops its token here, and is freed once no
        later step in flight holds it (``device_len`` counts the tokens read and in flight); one
        that finishes now while later steps hold it is freed when the last of them is read. Returns the
        ``(request, token, text piece)`` events if :meth:`_run` was asked for them (else an empty list), and
        counts the tokens taken in ``self._accepted``.

        This loop runs once per token, so it reads only what each request keeps for it (its stop
        ids, whether it has stop strings, its output limit)."""
        events, ctx, tokenizer, done = [], self.config.context_length, self.tokenizer, False
        record, dropped = self._events, 0
        for r, t, lp in zip(reqs, ids, lps):
            if r.finish_reason is not None:
                r.device_len -= 1
                if r.device_len <= r.length:   # the last step in flight that held it
                    self._release(r)
                dropped += 1
                continue
            t = int(t)
            out = r.out
            out.append(t)
            r.logprobs.append(lp)
            # _finish only for a token that may end r (most end nothing, and this runs for every token)
            if r.watch_text or t in r.stop_ids or len(out) >= r.max_out:
                _finish(r, ctx, tokenizer)
                if r.finish_reason is not None:
                    done = True
                    self._finished.append(r)
                    if r.device_len <= r.length:   # no step in flight holds it
                        self._release(r)
            if record:   # the text this token makes decodable, now: a later token of r may come in the same read
                events.append((r, t, _text_piece(r, tokenizer)))
        if done:
            running[:] = [r for r in running if r.finish_reason is None]
        self._accepted = len(reqs) - dropped
        return events

    def _sample(self, reqs: list[_Request], logits: torch.Tensor):
        params = [r.params for r in reqs]
        previous = [r.tokens for r in reqs] if any(p.repetition_penalty != 1 for p in params) else None
        return sample(logits, params, [r.generator for r in reqs], previous)

    def _prefill(self, admitted: list[_Request], running: list) -> list[_Event]:
        start = time.perf_counter()
        chunks = [(r.tokens[r.cached:], r.cached, r.blocks) for r in admitted]
        batch = gathered_batch(chunks, self.block_size, self.config.window, self.device)
        with self._autocast():
            logits = self._forward(self.model, self.cache, batch, self.decode_attention)
        # Plain requests (module docstring, "Overlap") are drawn as in a decode step: the temperatures
        # in one upload, nothing that waits for the forward; the others by sample(), on the host's lists.
        params, temps, generators, kinds = _settings(admitted)
        plain = all(p.plain for p in kinds)
        if plain:
            uniforms = None if all(p.greedy for p in kinds) else draw_uniforms(params, generators, self.device)
            next_ids, logprobs = self._draw(logits, self._upload(temps, torch.float32), uniforms)
        else:
            next_ids, logprobs = self._sample(admitted, logits.float())
        # each admitted request's row, position and block table, in one copy that does not wait for the forward
        state = self._upload([[r.row, r.length] + r.blocks + [0] * (self.max_blocks - len(r.blocks))
                              for r in admitted])
        rows = state[:, 0]
        for r in admitted:
            r.device_len = r.length + 1        # the token sampled here
        self.tables[rows] = state[:, 2:].to(torch.int32)
        self.positions[rows] = state[:, 1]
        self.last_token[rows] = next_ids
        running.extend(admitted)
        self._state = None                     # rows were handed to new requests
        s = self.stats
        s["prefill_tokens"] += batch.tokens.numel()
        s["shared_prefix_tokens"] += sum(r.cached for r in admitted)
        s["prefill_steps"] += 1
        drawn = _pack(next_ids, logprobs)
        if plain and self.overlap and self.config.attention != "mla":
            # the first tokens are read with the next decode step, launched before them (its inputs are
            # on the device already); MLA's decode batches are built from the host's tokens
            self._pending.append(self._in_flight(admitted, drawn, wait=False, prefill=True))
            events = []
        else:
            events = self._accept(admitted, *drawn.tolist(), running)
        s["prefill_seconds"] += time.perf_counter() - start
        return events

    def _preempt(self, r: _Request, waiting: deque, running: list) -> None:
        """Recompute preemption: free ``r``'s blocks, requeue it first, keep its tokens."""
        self._release(r)
        running.remove(r)
        waiting.appendleft(r)
        self.stats["preemptions"] += 1

    def _decode(self, waiting: deque, running: list) -> list[_Event]:
        """Launch one decode step for the running requests, then read the tokens of the oldest steps
        in flight until ``in_flight`` are left (module docstring, "Overlap"); returns the events of
        the tokens read."""
        bs, alloc = self.block_size, self.allocator
        # A request whose last token by length is in flight already sits this step out. The token fed
        # now sits at position device_len - 1; a request whose position starts a new block needs one.
        batch = [r for r in running if r.device_len < r.end]
        needy = [r for r in batch if (r.device_len - 1) // bs >= len(r.blocks)]
        events = []
        if len(needy) > alloc.num_free:
            # Preempting needs every token on the host: read the steps in flight (they may free blocks),
            # then preempt the newest requests until the blocks are there.
            events = self._drain(running)
            while True:
                batch = list(running)
                needy = [r for r in batch if (r.device_len - 1) // bs >= len(r.blocks)]
                if len(needy) <= alloc.num_free:
                    break
                self._preempt(running[-1], waiting, running)
        if needy:
            rows, cols, blocks = [], [], []
            for r in needy:
                r.blocks.append(alloc.allocate())
                rows.append(r.row)
                cols.append(len(r.blocks) - 1)
                blocks.append(r.blocks[-1])
            updates = self._upload([rows, cols, blocks])   # one small copy
            self.tables[updates[0], updates[1]] = updates[2].to(torch.int32)
        self._account(running)
        keep = 0    # steps left in flight: none if nothing was launched or the new step must be read now
        if batch:   # empty when every running request's last token is in flight
            self.stats["overlapped_steps"] += bool(self._pending)
            self._pending.append(self._launch(batch))
            keep = 0 if self._pending[-1].wait else self.in_flight
        return events + self._drain(running, keep)

    def _launch(self, batch: list[_Request]) -> _Step:
        """Start the decode step of ``batch`` on the device and the copy of its tokens to the host,
        without waiting for either."""
        cuda = self.device.type == "cuda"
        started = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            started.record()
        if self.config.attention == "mla":   # latents: the gathered path, built from the host's tokens
            pb = gathered_batch([(r.out[-1:], r.length - 1, r.blocks) for r in batch],
                                self.block_size, self.config.window, self.device)
            with self._autocast():
                logits = paged_forward(self.model, self.cache, pb)
            next_ids, logprobs = self._sample(batch, logits.float())
            drawn, wait = _pack(next_ids, logprobs), True
        else:
            state = self._batch_state(batch)
            uniforms = None
            if state["plain"] and not state["greedy"]:
                uniforms = draw_uniforms(state["params"], state["generators"], self.device,
                                         out=self._graph_uniforms(state))
            width = None if self.cuda_graphs else max(len(r.blocks) for r in batch)
            logits, drawn = self._decode_step(state, uniforms, width)
            if not state["plain"]:   # filters or penalties: sample from the logits
                next_ids, logprobs = self._sample(batch, logits.float())
                self.last_token[state["rows"]] = next_ids
                drawn = _pack(next_ids, logprobs)
            wait = state["host_tokens"] or not self.overlap
        for r in batch:
            r.device_len += 1
        self.stats["decode_steps"] += 1
        return self._in_flight(batch, drawn, wait, started=started)

    def _in_flight(self, requests: list[_Request], drawn: torch.Tensor, wait: bool, prefill: bool = False,
                   started: torch.cuda.Event | None = None) -> _Step:
        """The step whose ``(2, B)`` ``drawn`` ids and log-probs the host reads later: on CUDA copied
        into pinned host memory (so the copy does not block the host), with an event recorded after it."""
        if self.device.type != "cuda":
            return _Step(requests, drawn, wait, prefill=prefill)
        host = self._host_buffer(drawn)
        host.copy_(drawn, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        return _Step(requests, host, wait, started, done, prefill)

    def _host_buffer(self, drawn: torch.Tensor) -> torch.Tensor:
        """The next pinned host buffer in turn, as a tensor of ``drawn``'s shape (allocating a pinned
        tensor for every step costs the host about twice the copy itself)."""
        buffer = self._host_buffers[self._host_turn]
        self._host_turn = (self._host_turn + 1) % len(self._host_buffers)
        return buffer[:drawn.numel()].view(drawn.shape)

    def _read(self, step: _Step, running: list) -> list[_Event]:
        """Wait for ``step``'s tokens and take them in (:meth:`_accept`)."""
        s = self.stats
        if step.done is not None:
            start = time.perf_counter()
            step.done.synchronize()
            s["decode_wait_seconds"] += time.perf_counter() - start
            if not step.prefill:
                s["decode_device_seconds"] += step.started.elapsed_time(step.done) / 1e3
        ids, lps = step.tokens.tolist()
        events = self._accept(step.requests, ids, lps, running)
        if not step.prefill:
            s["decode_tokens"] += self._accepted
        return events

    def _drain(self, running: list, keep: int = 0) -> list[_Event]:
        """Read the oldest steps in flight until ``keep`` are left (none: afterwards the host knows
        every token)."""
        events = []
        while len(self._pending) > keep:
            events += self._read(self._pending.popleft(), running)
        return events

    def _upload(self, values, dtype=torch.long) -> torch.Tensor:
        """Host ``values`` as a device tensor, without waiting for the step in flight (:func:`upload`)."""
        return upload(values, self.device, dtype)

    def _batch_state(self, batch: list) -> dict:
        """The decode batch as device tensors, rebuilt only when its rows changed: its ``rows``,
        ``temperatures`` (0 for greedy), whether every request is ``plain`` (sampled inside the step)
        or ``greedy``, whether any needs the tokens on the host (``host_tokens``: a repetition
        penalty), its ``params`` and ``generators``; with CUDA graphs the same padded to the graph's
        batch size (:func:`graph_batch_size`; ``padded_rows`` point at the dummy row)."""
        rows = [r.row for r in batch]
        if self._state is not None and self._state["row_list"] == rows:
            return self._state
        params, temps, generators, kinds = _settings(batch)
        state = dict(row_list=rows, params=params, generators=generators, size=len(rows),
                     plain=all(p.plain for p in kinds), greedy=all(p.greedy for p in kinds),
                     host_tokens=any(p.repetition_penalty != 1 for p in kinds))
        if self.cuda_graphs:
            state["size"] = size = graph_batch_size(len(rows))
            rows, temps = rows + [self.dummy] * (size - len(rows)), temps + [0.0] * (size - len(rows))
        # rows and temperatures in one upload (float64 holds every row index exactly)
        both = self._upload([rows, temps], torch.float64)
        state["padded_rows"], state["padded_temperatures"] = both[0].long(), both[1].float()
        state["rows"] = state["padded_rows"][:len(batch)]
        self._state = state
        return state

    def _account(self, running: list) -> None:
        """KV memory statistics, summed over decode steps (so their ratio is a time average)."""
        s, used = self.stats, self.allocator.num_used
        s["peak_kv_blocks"] = max(s["peak_kv_blocks"], used)
        s["kv_bytes_in_use"] += used * self.cache.block_bytes
        s["kv_bytes_of_tokens"] += self.cache.bytes_of_tokens(sum(r.device_len for r in running))

    # ------------------------------------------------------------------------------------------
    # The decode step, plain or through CUDA graphs

    def _decode_batch(self, rows: torch.Tensor, width: int | None = None) -> PagedBatch:
        """Everything a decode step needs, gathered on the device from the running ``rows`` ``(B,)``;
        ``width``: the block tables' columns to keep (None: all, the fixed shape a CUDA graph needs;
        fewer save the reference attention from gathering blocks no sequence has yet). On a GPU, at
        the full width, one kernel (:func:`lmfs.kernels.engine_step.gather_decode_batch`)."""
        if width is None and self._step_kernels is not None:
            return self._step_kernels.gather_decode_batch(rows, self.positions, self.tables, self.last_token,
                                                          self.block_size)
        positions = self.positions[rows]
        tables = self.tables[rows, :width]
        block = tables.gather(1, (positions // self.block_size)[:, None])[:, 0].long()
        slots = block * self.block_size + positions % self.block_size
        return PagedBatch(self.last_token[rows], positions, slots, block_tables=tables,
                          seq_lens=(positions + 1).to(torch.int32))

    def _step(self, rows: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor | None,
              width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step on the device, no host sync: the forward of ``rows`` ``(B,)`` (block tables
        cut to ``width`` columns; the fused forward when on), a draw at ``temperatures`` ``(B,)``
        (0: greedy) with ``uniforms`` ``(B,)`` (None: all greedy), and the rows' last tokens and
        positions advanced. Returns the logits ``(B, V)`` and ``(2, B)`` float64 sampled ids and
        their log-probs."""
        with self._autocast():   # inside the step, so that a CUDA graph captures the weights' casts
            logits = self._forward(self.model, self.cache, self._decode_batch(rows, width), self.decode_attention)
        if uniforms is None and self._step_kernels is not None:   # greedy, on a GPU: draw and advance in one kernel
            return logits, self._step_kernels.greedy_advance(logits, rows, self.last_token, self.positions, self.dummy)
        next_ids, logprobs = self._draw(logits, temperatures, uniforms)
        self.last_token[rows] = next_ids
        self.positions[rows] += 1
        # padded rows wrote here: keep the dummy row at position 0 (zero_ on a view, since indexing with
        # a Python int and assigning a number copies from the host, which a CUDA graph cannot capture)
        self.positions.narrow(0, self.dummy, 1).zero_()
        return logits, _pack(next_ids, logprobs)

    @staticmethod
    def _draw(logits: torch.Tensor, temperatures: torch.Tensor,
              uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The draw of plain requests on the device, as :func:`~lmfs.inference.sample` would draw them:
        ``(next_ids, logprobs)`` from ``logits`` ``(B, V)`` at ``temperatures`` ``(B,)`` (0: greedy) with
        ``uniforms`` ``(B,)`` (None: every row greedy: the argmax, log-probs at temperature 1)."""
        logits = logits.float()
        if uniforms is None:
            return sample_scaled(logits, None, None)
        greedy = temperatures == 0
        # masked_fill takes the 1.0 as a kernel argument; torch.where would copy it from the host,
        # which a CUDA graph cannot capture
        processed = logits / temperatures.masked_fill(greedy, 1.0)[:, None]
        return sample_scaled(processed, greedy, uniforms)

    def _decode_step(self, state: dict, uniforms: torch.Tensor | None,
                     width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_step` for the decode batch, whose longest block table has ``width`` blocks (None
        with CUDA graphs): called directly, or replayed from its CUDA graph (which reads the tables'
        full width). A batch of greedy requests only (``uniforms`` None) has graphs of its own, which
        skip the inverse-CDF draw (an exponential, a cumulative sum and a search over the vocabulary)."""
        B, size = len(state["rows"]), state["size"]
        key = (size, uniforms is None)
        if self.cuda_graphs and key not in self._graphs:
            try:
                self._graphs[key] = self._capture(*key)
                self._filled.pop(key, None)
            except RuntimeError as err:   # a step that cannot be captured still decodes, only slower
                warnings.warn(f"capturing the decode step in a CUDA graph failed, decoding without graphs: {err}",
                              stacklevel=2)
                self.cuda_graphs = False
        if not self.cuda_graphs:
            return self._step(state["rows"], state["padded_temperatures"][:B], uniforms, width)
        graph, static_rows, static_temps, static_uniforms, static_logits, static_drawn = self._graphs[key]
        if self._filled.get(key) is not state:   # a new batch: into the graph's buffers (the same: there already)
            static_rows.copy_(state["padded_rows"])
            static_temps.copy_(state["padded_temperatures"])
            self._filled[key] = state
        if uniforms is not None and uniforms.data_ptr() != static_uniforms.data_ptr():
            static_uniforms[:B].copy_(uniforms)   # (not drawn into it: the graph was captured just now)
        graph.replay()
        self.stats["cuda_graphs"] = True
        return static_logits[:B], static_drawn[:, :B]

    def _graph_uniforms(self, state: dict) -> torch.Tensor | None:
        """The uniforms' input buffer of the sampling graph ``state`` replays, cut to its rows (None
        without one yet), for :func:`draw_uniforms` to draw into: no separate draw and copy."""
        captured = self._graphs.get((state["size"], False)) if self.cuda_graphs else None
        return None if captured is None else captured[3][:len(state["rows"])]

    def _capture(self, size: int, greedy: bool) -> tuple:
        """Capture :meth:`_step` for ``size`` rows (all ``greedy``, or not); the graph reads its rows,
        temperatures and uniforms from static buffers filled before each replay."""
        static_rows = torch.full((size,), self.dummy, dtype=torch.long, device=self.device)
        static_temps = torch.ones(size, device=self.device)
        static_uniforms = None if greedy else torch.full((size,), 0.5, device=self.device)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph, (static_logits, static_drawn) = capture_graph(
            lambda: self._step(static_rows, static_temps, static_uniforms), self.device, self._graph_pool)
        return graph, static_rows, static_temps, static_uniforms, static_logits, static_drawn

    def _weight_addresses(self) -> tuple:
        return tuple((p.data_ptr(), p.dtype) for p in self.model.parameters())

    def _check_weights(self) -> None:
        """Drop the CUDA graphs if the weights moved (new tensors or dtype) since they were captured:
        a graph holds the addresses it read. In-place updates keep the addresses, and the graphs.
        The fused forward's merged weights are rebuilt from the new tensors; its 16-bit copies (under
        autocast) take in the in-place updates, here, before any step: a replay reads the copies."""
        where = self._weight_addresses()
        if where != self._weights:
            self._graphs.clear()
            if self._fused is not None:
                self._fused = self._forward = self._fused_forward(type(self._fused))
                where = self._weight_addresses()   # the parameters may now point into the merged buffers
            self._weights = where
        if self._fused is not None:
            self._fused.refresh(self.model)


class Generation:
    """A :meth:`LLM.start` under way: ``result()`` runs it to the end and returns one
    :class:`RequestOutput` per prompt, in order; ``close()`` abandons it (its requests' KV blocks
    and rows are freed)."""

    def __init__(self, llm: "LLM", requests: list, on_finish: Callable[[RequestOutput], None] | None):
        self._llm, self._on_finish = llm, on_finish
        self._outputs: list[RequestOutput | None] = [None] * len(requests)
        self._steps: Iterator | None = None
        self.done = False

    def _finish(self, r: _Request) -> None:
        self._outputs[r.index] = out = r.output(self._llm.tokenizer)
        if self._on_finish is not None:
            self._on_finish(out)

    def _advance(self) -> bool:
        """One scheduler step; False once every request has finished."""
        llm = self._llm
        try:
            next(self._steps)
        except StopIteration:
            self.done = True
            llm._started = None
            return False
        for r in llm._finished:   # every request that runs finishes in _accept, which lists it here
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
            self._steps.close()      # the scheduler's clean-up frees what its requests hold
        if self._llm._started is self:
            self._llm._started = None


@dataclass
class _Step:
    """A decode step launched on the device: its ``requests``, its ``(2, B)`` ``tokens`` (ids and
    log-probs; on CUDA a pinned host buffer the copy lands in once ``done`` has passed, with
    ``started`` for the device time), and whether the engine must ``wait`` for it before the next
    step (the next batch needs its tokens on the host)."""

    requests: list[_Request]
    tokens: torch.Tensor
    wait: bool
    started: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    prefill: bool = False          # a prefill's first tokens, read with the decode step after it


def graph_batch_size(n: int) -> int:
    """The batch size of the CUDA graph that runs a decode batch of ``n`` requests: 1, 2, 4, then
    the next multiple of 8 up to 256 and of 16 above. Padded rows are wasted work and every size is
    one more graph to capture: a batch of 201 pads to 208 (3% waste) where the next power of two,
    256, would waste 21%, for 35 graphs up to 256 rows instead of 9. (Multiples of 16 above 128
    padded the shrinking batch of a GRPO rollout of 256 answers by 3.3% of its rows.)"""
    if n <= 4:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 256 else 16
    return -(-n // step) * step


def _pack(next_ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Sampled ids and their log-probs ``(B,)`` as one ``(2, B)`` float64 tensor, so that the host
    reads both in one copy (float64 holds every token id exactly)."""
    return torch.stack([next_ids.double(), logprobs.double()])


# ---------------------------------------------------------------------------------------------
# Static batching: the baseline continuous batching is compared with

@torch.no_grad()
def generate_static(model, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                    batch_size: int | None = None, tokenizer=None) -> list[RequestOutput]:
    """Generate with static batching and the contiguous :class:`~lmfs.inference.KVCache`.

    Prompts are taken ``batch_size`` at a time (all at once by default); each batch is left-padded
    to its longest prompt, prefilled, then decoded one token per step for every row until its
    *last* request finishes: rows that finished early keep computing padding. That waste is what
    continuous batching (:class:`LLM`) removes. Invalid requests get ``finish_reason="error"``.
    Returns one :class:`RequestOutput` per prompt, in order.
    """
    device = next(model.parameters()).device
    ctx = model.config.context_length
    token_lists = _as_token_lists(prompts, tokenizer)
    requests = [_Request(i, p, sp, device) for i, (p, sp) in
                enumerate(zip(token_lists, _params_list(params, len(token_lists))))]
    valid = []
    for r in requests:
        n = len(r.prompt)
        if n == 0 or n >= ctx:
            r.finish_reason, r.error = "error", ("empty prompt" if n == 0 else
                                                 f"prompt of {n} tokens does not fit context_length={ctx}")
        else:
            valid.append(r)
    batch_size = batch_size or max(len(valid), 1)
    for first in range(0, len(valid), batch_size):
        batch = valid[first:first + batch_size]
        longest = max(len(r.prompt) for r in batch)
        pad = torch.tensor([longest - len(r.prompt) for r in batch], device=device)
        idx = torch.tensor([[0] * (longest - len(r.prompt)) + r.prompt for r in batch], device=device)
        max_len = min(ctx, longest + max(r.params.max_tokens for r in batch))
        cache = KVCache.for_model(model, len(batch), max_len, pad=pad)
        logits = forward_cached(model, idx, cache)[:, -1]
        while True:
            params = [r.params for r in batch]
            previous = [r.tokens for r in batch] if any(p.repetition_penalty != 1 for p in params) else None
            next_ids, logprobs = sample(logits, params, [r.generator for r in batch], previous)
            ids, lps = _pack(next_ids, logprobs).tolist()
            for r, t, lp in zip(batch, ids, lps):
                if r.finish_reason is None:
                    r.out.append(int(t))
                    r.logprobs.append(lp)
                    _finish(r, ctx, tokenizer)
            if all(r.finish_reason is not None for r in batch) or cache.length >= max_len:
                break
            logits = forward_cached(model, next_ids[:, None], cache)[:, -1]
        for r in batch:   # the cache ran out before max_tokens: the context is full
            r.finish_reason = r.finish_reason or "length"
    return [r.output(tokenizer) for r in requests]

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
  log-probs to the host: the step's only sync. What the host does per step is bookkeeping of
  Python lists (new blocks, finished requests), never a loop over the vocabulary.
* **CUDA graphs** (GPU): the whole decode step, forward and sampling, is captured once per padded
  batch size (powers of two; padded rows read and write a dummy row and the scratch block) and
  replayed, so a step costs one launch instead of a thousand. With ``compile=True`` the step is
  compiled with ``torch.compile`` before capture, which fuses the many small element-wise kernels
  of a layer (norms, RoPE, activations, residual adds): at batch 1 those, not the weight reads,
  dominate the step of an uncompiled graph. Compiling costs about a minute per engine, so it pays
  for long runs (a benchmark, an RL loop that keeps one engine), not for a quick evaluation.
  If the weights' storage changes between calls (a new dtype, new tensors), the graphs are
  captured again; weights updated in place (an optimiser step) are read by the next replay as
  they are.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lmfs.inference.kv_cache import (BlockAllocator, KVCache, PagedKVCache, kv_bytes_per_token,
                                     paged_attention_reference)
from lmfs.inference.runner import PagedBatch, forward_cached, gathered_batch, paged_forward
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
        return RequestOutput(self.index, self.prompt, list(self.out), text,
                             list(self.logprobs) if self.params.logprobs and self.error is None else None,
                             self.finish_reason, self.error)


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
        out.append([int(t) for t in p])
    return out


def _params_list(params, n: int) -> list[SamplingParams]:
    params = SamplingParams() if params is None else params
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    return params


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
    ``cuda_graphs``: ``"auto"`` (on for CUDA, off on the CPU), True or False; ``compile``:
    ``torch.compile`` the decode step (module docstring; a compile error falls back to the plain
    step with a warning); ``attention``:
    decode attention, ``"auto"`` (the Triton kernel on CUDA when importable and the model has no
    sliding window or soft-cap, else the reference), ``"triton"`` or ``"reference"``;
    ``progress``: a progress bar over requests (None: only on a terminal or notebook).

    ``stats`` (after each call): prefill/decode tokens, seconds and steps, preemptions, prompt
    tokens served from shared prefix blocks, the peak number of KV blocks in use, and KV bytes in
    use vs bytes of the tokens cached, summed over decode steps (``kv_memory_ratio``, their ratio).
    Tokens of a shared block count once per request using it. A sliding-window model keeps the
    blocks that have left its window (simple, not minimal).
    """

    def __init__(self, model, tokenizer=None, block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_batch_size: int = 256, max_batch_tokens: int = 4096, cuda_graphs="auto",
                 attention: str = "auto", progress: bool | None = None, compile: bool = False):
        cfg = model.config
        param = next(model.parameters())
        self.model, self.tokenizer, self.config = model, tokenizer, cfg
        self.device, self.dtype = param.device, param.dtype
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_batch_size={max_batch_size} and max_batch_tokens={max_batch_tokens} "
                             "must be positive")
        self.block_size, self.max_batch_size, self.max_batch_tokens = block_size, max_batch_size, max_batch_tokens
        self.progress = progress
        if kv_cache_tokens is None:
            kv_cache_tokens = self._default_kv_tokens()
        self.cache = PagedKVCache.for_model(model, kv_cache_tokens, block_size)
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
        if not isinstance(compile, bool):
            raise ValueError(f"compile={compile!r}: use True or False")
        self.compile = compile
        self._step_fn = None                  # the decode step, compiled or not (made on first use)
        self._graphs: dict[int, tuple] = {}
        self._graph_pool = None
        self._weights = None                  # where the weights lived when the graphs were captured
        self._state = None                    # the running batch's device tensors (_batch_state)
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

    @staticmethod
    def _empty_stats() -> dict:
        return dict(requests=0, prefill_tokens=0, prefill_seconds=0.0, prefill_steps=0, decode_tokens=0,
                    decode_seconds=0.0, decode_steps=0, preemptions=0, shared_prefix_tokens=0,
                    peak_kv_blocks=0, kv_bytes_in_use=0, kv_bytes_of_tokens=0, kv_memory_ratio=None)

    # ------------------------------------------------------------------------------------------
    # Public API

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings, with a tokenizer, or lists of token ids); ``params``:
        one :class:`SamplingParams` for all or one per prompt. Returns one :class:`RequestOutput`
        per prompt, in order. A bad request (empty, too long, never fits the KV budget) gets
        ``finish_reason="error"`` and the others go on."""
        requests = self._requests(prompts, params)
        for _ in self._run(requests, progress):
            pass
        return [r.output(self.tokenizer) for r in requests]

    def stream(self, prompts, params=None, progress: bool | None = False) -> Iterator[tuple[int, int, str]]:
        """Like :meth:`generate`, yielding ``(request index, token id, text piece)`` as each token is
        produced (the text piece is ``""`` without a tokenizer, or while a character is incomplete)."""
        requests = self._requests(prompts, params)
        for req, token in self._run(requests, progress):
            yield req.index, token, _text_piece(req, self.tokenizer)

    # ------------------------------------------------------------------------------------------
    # Requests and the scheduler

    def _requests(self, prompts, params) -> list[_Request]:
        token_lists = _as_token_lists(prompts, self.tokenizer)
        requests = [_Request(i, p, sp, self.device)
                    for i, (p, sp) in enumerate(zip(token_lists, _params_list(params, len(token_lists))))]
        for r in requests:
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

    def _run(self, requests: list[_Request], progress) -> Iterator[tuple[_Request, int]]:
        """Schedule until every request is finished, yielding ``(request, token)`` per new token."""
        from tqdm.auto import tqdm
        self.stats = self._empty_stats()
        self._check_weights()
        self._state = None
        self.stats["requests"] = len(requests)
        progress = self.progress if progress is None else progress
        bar = tqdm(total=len(requests), desc="requests", disable=None if progress is None else not progress)
        bar.update(sum(r.finish_reason is not None for r in requests))
        waiting = deque(r for r in requests if r.finish_reason is None)
        running: list[_Request] = []
        try:
            while waiting or running:
                admitted = self._admit(waiting, running)
                if admitted:
                    events = self._prefill(admitted, running)
                else:
                    events = self._decode(waiting, running)
                for req, token in events:
                    yield req, token
                    if req.finish_reason is not None:
                        bar.update(1)
        finally:
            bar.close()
            s = self.stats   # time-averaged KV memory in use per byte of cached tokens (>= 1)
            s["kv_memory_ratio"] = s["kv_bytes_in_use"] / s["kv_bytes_of_tokens"] if s["kv_bytes_of_tokens"] else None
            for r in running:   # a consumer that stops early leaves no blocks behind
                self._release(r)

    def _admit(self, waiting: deque, running: list) -> list[_Request]:
        """Take waiting requests, first come first served, while rows, blocks and the prefill token
        budget allow; give each its blocks (sharing full prefix blocks already in the cache)."""
        admitted, tokens = [], 0
        bs, alloc = self.block_size, self.allocator
        while waiting and len(running) + len(admitted) < self.max_batch_size:
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
        self._state = None   # the running batch changes
        for b in r.blocks:
            self.allocator.release(b)
        r.blocks = []
        if r.row is not None:
            self.free_rows.append(r.row)
            r.row = None

    def _accept(self, reqs: list[_Request], ids: list[float], lps: list[float],
                running: list) -> list[tuple[_Request, int]]:
        """Append each request's sampled token (``ids``, ``lps``: host lists, one entry per request),
        finish and free those that are done."""
        events = []
        for r, t, lp in zip(reqs, ids, lps):
            t = int(t)
            r.out.append(t)
            r.logprobs.append(lp)
            _finish(r, self.config.context_length, self.tokenizer)
            events.append((r, t))
            if r.finish_reason is not None:
                self._release(r)
        running[:] = [r for r in running if r.finish_reason is None]
        return events

    def _sample(self, reqs: list[_Request], logits: torch.Tensor):
        params = [r.params for r in reqs]
        previous = [r.tokens for r in reqs] if any(p.repetition_penalty != 1 for p in params) else None
        return sample(logits, params, [r.generator for r in reqs], previous)

    def _prefill(self, admitted: list[_Request], running: list) -> list[tuple[_Request, int]]:
        start = time.perf_counter()
        chunks = [(r.tokens[r.cached:], r.cached, r.blocks) for r in admitted]
        batch = gathered_batch(chunks, self.block_size, self.config.window, self.device)
        logits = paged_forward(self.model, self.cache, batch, self.decode_attention)
        next_ids, logprobs = self._sample(admitted, logits)
        rows = torch.tensor([r.row for r in admitted], device=self.device)
        table = torch.zeros(len(admitted), self.max_blocks, dtype=torch.int32)
        for i, r in enumerate(admitted):
            table[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        self.tables[rows] = table.to(self.device)
        self.positions[rows] = torch.tensor([len(r.tokens) for r in admitted], device=self.device)
        self.last_token[rows] = next_ids
        running.extend(admitted)
        self._state = None
        s = self.stats
        s["prefill_tokens"] += batch.tokens.numel()
        s["shared_prefix_tokens"] += sum(r.cached for r in admitted)
        s["prefill_steps"] += 1
        events = self._accept(admitted, *_to_host(next_ids, logprobs), running)
        s["prefill_seconds"] += time.perf_counter() - start
        return events

    def _preempt(self, r: _Request, waiting: deque, running: list) -> None:
        """Recompute preemption: free ``r``'s blocks, requeue it first, keep its tokens."""
        self._release(r)
        running.remove(r)
        waiting.appendleft(r)
        self.stats["preemptions"] += 1

    def _decode(self, waiting: deque, running: list) -> list[tuple[_Request, int]]:
        """One token for every running request."""
        start = time.perf_counter()
        bs = self.block_size
        # The token fed now sits at position len(tokens) - 1; a request whose position starts a new
        # block needs one. Preempt the newest requests until the blocks are there.
        needy = lambda r: (r.length - 1) // bs >= len(r.blocks)   # noqa: E731
        while sum(map(needy, running)) > self.allocator.num_free:
            self._preempt(running[-1], waiting, running)
        new_rows, new_cols, new_blocks = [], [], []
        for r in running:
            if needy(r):
                r.blocks.append(self.allocator.allocate())
                new_rows.append(r.row)
                new_cols.append(len(r.blocks) - 1)
                new_blocks.append(r.blocks[-1])
        if new_rows:
            updates = torch.tensor([new_rows, new_cols, new_blocks]).to(self.device)   # one small copy
            self.tables[updates[0], updates[1]] = updates[2].to(torch.int32)
        self._account(running)

        if self.config.attention == "mla":   # latents: the gathered path, sampled on the host side
            batch = gathered_batch([(r.out[-1:], r.length - 1, r.blocks) for r in running],
                                   bs, self.config.window, self.device)
            next_ids, logprobs = self._sample(running, paged_forward(self.model, self.cache, batch))
            ids, lps = _to_host(next_ids, logprobs)
        else:
            state = self._batch_state(running)
            uniforms = None
            if state["plain"] and not state["greedy"]:
                uniforms = draw_uniforms([r.params for r in running], [r.generator for r in running], self.device)
            logits, drawn = self._decode_step(state, uniforms, max(len(r.blocks) for r in running))
            if state["plain"]:
                ids, lps = drawn.tolist()             # the step's one device-to-host copy
            else:                                     # filters or penalties: sample from the logits
                next_ids, logprobs = self._sample(running, logits)
                self.last_token[state["rows"]] = next_ids
                ids, lps = _to_host(next_ids, logprobs)
        self.stats["decode_tokens"] += len(running)
        self.stats["decode_steps"] += 1
        events = self._accept(list(running), ids, lps, running)
        self.stats["decode_seconds"] += time.perf_counter() - start
        return events

    def _batch_state(self, running: list) -> dict:
        """The running batch as device tensors, rebuilt only when the batch changed: its ``rows``,
        ``temperatures`` (0 for greedy), whether every request is ``plain`` (sampled inside the step)
        or ``greedy``; with CUDA graphs the same padded to the graph's batch size (``padded_rows``
        point at the dummy row)."""
        if self._state is None:
            rows = [r.row for r in running]
            temps = [r.params.temperature for r in running]
            state = dict(plain=all(r.params.plain for r in running), greedy=all(r.params.greedy for r in running),
                         size=len(rows))
            if self.cuda_graphs:
                state["size"] = size = 1 << (len(rows) - 1).bit_length()   # few graphs to capture
                rows, temps = rows + [self.dummy] * (size - len(rows)), temps + [0.0] * (size - len(rows))
            state["padded_rows"] = torch.tensor(rows, device=self.device)
            state["padded_temperatures"] = torch.tensor(temps, dtype=torch.float32, device=self.device)
            state["rows"] = state["padded_rows"][:len(running)]
            self._state = state
        return self._state

    def _account(self, running: list) -> None:
        """KV memory statistics, summed over decode steps (so their ratio is a time average)."""
        s, used = self.stats, self.allocator.num_used
        s["peak_kv_blocks"] = max(s["peak_kv_blocks"], used)
        s["kv_bytes_in_use"] += used * self.cache.block_bytes
        s["kv_bytes_of_tokens"] += self.cache.bytes_of_tokens(sum(r.length for r in running))

    # ------------------------------------------------------------------------------------------
    # The decode step, plain or through CUDA graphs

    def _decode_batch(self, rows: torch.Tensor, width: int | None = None) -> PagedBatch:
        """Everything a decode step needs, gathered on the device from the running ``rows`` ``(B,)``;
        ``width``: the block tables' columns to keep (None: all, the fixed shape a CUDA graph needs;
        fewer save the reference attention from gathering blocks no sequence has yet)."""
        positions = self.positions[rows]
        tables = self.tables[rows, :width]
        block = tables.gather(1, (positions // self.block_size)[:, None])[:, 0].long()
        slots = block * self.block_size + positions % self.block_size
        return PagedBatch(self.last_token[rows], positions, slots, block_tables=tables,
                          seq_lens=(positions + 1).to(torch.int32))

    def _step(self, rows: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor | None,
              width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step on the device, no host sync: the forward of ``rows`` ``(B,)`` (block tables
        cut to ``width`` columns), a draw at ``temperatures`` ``(B,)`` (0: greedy) with ``uniforms``
        ``(B,)`` (None: all greedy), and the rows' last tokens and positions advanced. Returns the
        logits ``(B, V)`` and ``(2, B)`` float64 sampled ids and their log-probs."""
        logits = paged_forward(self.model, self.cache, self._decode_batch(rows, width), self.decode_attention)
        greedy = temperatures == 0
        # masked_fill takes the 1.0 as a kernel argument; torch.where would copy it from the host,
        # which a CUDA graph cannot capture
        processed = logits.float() / temperatures.masked_fill(greedy, 1.0)[:, None]
        next_ids, logprobs = sample_scaled(processed, greedy, uniforms)
        self.last_token[rows] = next_ids
        self.positions[rows] += 1
        # padded rows wrote here: keep the dummy row at position 0 (zero_ on a view, since indexing with
        # a Python int and assigning a number copies from the host, which a CUDA graph cannot capture)
        self.positions.narrow(0, self.dummy, 1).zero_()
        return logits, torch.stack([next_ids.double(), logprobs.double()])

    def _step_function(self):
        """The decode step, compiled once when ``self.compile`` (falls back to the plain step)."""
        if self._step_fn is None:
            self._step_fn = self._step
            if self.compile:
                if self.decode_attention is not paged_attention_reference:   # the Triton kernel: an opaque op
                    from lmfs.kernels.paged_attention import paged_decode_attention_op
                    self.decode_attention = paged_decode_attention_op
                self._step_fn = torch.compile(self._step)
        return self._step_fn

    def _run_step(self, *args):
        """The (compiled) step; a compile error switches compilation off, with a warning, for good."""
        try:
            return self._step_function()(*args)
        except Exception as err:   # torch.compile failing on an unusual model must not stop generation
            if not self.compile:
                raise
            warnings.warn(f"torch.compile of the decode step failed, decoding without it: {err}", stacklevel=3)
            self.compile, self._step_fn = False, self._step
            return self._step(*args)

    def _decode_step(self, state: dict, uniforms: torch.Tensor | None,
                     width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_step` for the running batch, whose longest block table has ``width`` blocks:
        called directly, or replayed from its CUDA graph (which reads the tables' full width)."""
        B, size = len(state["rows"]), state["size"]
        if self.cuda_graphs and size not in self._graphs:
            try:
                self._graphs[size] = self._capture(size)
            except RuntimeError as err:   # a step that cannot be captured still decodes, only slower
                warnings.warn(f"capturing the decode step in a CUDA graph failed, decoding without graphs: {err}",
                              stacklevel=2)
                self.cuda_graphs = False
        if not self.cuda_graphs:
            return self._run_step(state["rows"], state["padded_temperatures"][:B], uniforms, width)
        graph, static_rows, static_temps, static_uniforms, static_logits, static_drawn = self._graphs[size]
        static_rows.copy_(state["padded_rows"])
        static_temps.copy_(state["padded_temperatures"])
        if uniforms is not None:
            static_uniforms[:B].copy_(uniforms)
        graph.replay()
        return static_logits[:B], static_drawn[:, :B]

    def _capture(self, size: int) -> tuple:
        """Capture :meth:`_step` for ``size`` rows; the graph reads its rows, temperatures and uniforms
        from static buffers filled before each replay."""
        static_rows = torch.full((size,), self.dummy, dtype=torch.long, device=self.device)
        static_temps = torch.ones(size, device=self.device)
        static_uniforms = torch.full((size,), 0.5, device=self.device)
        if self.compile and size > 1:   # one compiled step serves every padded size above 1
            for t in (static_rows, static_temps, static_uniforms):
                torch._dynamo.mark_dynamic(t, 0)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):             # warm-up (compilation, kernel selection, Triton autotuning)
            for _ in range(2):
                self._run_step(static_rows, static_temps, static_uniforms)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                static_logits, static_drawn = self._step_function()(static_rows, static_temps, static_uniforms)
        except Exception as err:   # compiled code that cannot be captured: capture the plain step
            if not self.compile:
                raise
            warnings.warn(f"capturing the compiled decode step failed, capturing it uncompiled: {err}", stacklevel=3)
            self.compile, self._step_fn = False, self._step
            return self._capture(size)
        return graph, static_rows, static_temps, static_uniforms, static_logits, static_drawn

    def _check_weights(self) -> None:
        """Drop the CUDA graphs if the weights moved (new tensors or dtype) since they were captured:
        a graph holds the addresses it read. In-place updates keep the addresses, and the graphs."""
        where = tuple((p.data_ptr(), p.dtype) for p in self.model.parameters())
        if where != self._weights:
            self._graphs.clear()
            self._weights = where


def _to_host(next_ids: torch.Tensor, logprobs: torch.Tensor) -> list[list[float]]:
    """Ids and log-probs ``(B,)`` as two host lists, in one copy."""
    return torch.stack([next_ids.double(), logprobs.double()]).tolist()


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
            ids, lps = _to_host(next_ids, logprobs)
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

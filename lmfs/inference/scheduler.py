"""The scheduler of :class:`~lmfs.inference.LLM`: which requests run at each step. Plain Python.

It knows nothing about the device: it holds the requests (:class:`Request`) in a waiting queue and a
running list, hands out KV blocks from a :class:`~lmfs.inference.BlockAllocator` and batch rows, and
takes in the tokens a model runner computed. Each step is one :class:`ScheduledBatch`:

* a **prefill**: waiting requests are admitted, first come first served, while batch rows
  (``max_batch_size``), KV blocks and the step's prompt-token budget (``max_batch_tokens``; a longer
  prompt runs alone) allow. A prompt whose first full blocks are already in the cache (the same
  tokens, hashed block by block) shares them and computes only the rest.
* a **decode**: every running request advances one token. A request whose next token starts a new
  block gets one; when none is free the most recently admitted request is *preempted*: its blocks
  are freed and it goes back to the front of the queue with the tokens it generated, to be
  recomputed later (every request finishes; a seeded request keeps its generator, so its output
  does not change).

:meth:`Scheduler.accept` appends the tokens a runner hands back (only committed tokens: the ids
and log-probs the host has read) and finishes requests: a stop token, a stop string (its text is
cut before it), ``max_tokens``, or a full context. A finished request frees its blocks and row at
once, and the next step can admit another: batches never wait for their slowest member.

A runner may launch a step before it hands back the tokens of the steps before it (steps in
flight). The scheduler counts the positions it has scheduled (``Request.device_len``: the tokens
accepted plus those scheduled and not yet handed back) and nothing else about them: a request whose
last token by length is scheduled sits the next steps out, a request that finishes while later
steps still hold it drops their tokens and frees its blocks once the last of them is handed back,
and preemption (which needs every token) first asks for a decode batch of no requests, which a
runner answers by handing back every step in flight.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass, field

import torch

from lmfs.inference.kv_cache import BlockAllocator
from lmfs.inference.sampling import SamplingParams


@dataclass
class RequestOutput:
    """The result of one request: generated ``token_ids``, their ``logprobs`` (None if not asked
    for), the decoded ``text`` (None without a tokenizer), ``finish_reason`` ``"stop"`` (a stop token
    or string), ``"length"`` (``max_tokens`` or the context is full) or ``"error"`` (then ``error``
    says why and nothing was generated)."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    decoded: str | None = field(default=None, repr=False)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def text(self) -> str | None:
        """The decoded output (None without a tokenizer). A request that failed has none: reading
        it raises :class:`RequestFailed` with the reason, rather than handing on a silent None."""
        if self.finish_reason == "error":
            raise RequestFailed(f"request {self.index} failed, so it has no text: {self.error}")
        return self.decoded


class RequestFailed(ValueError):
    """Reading the text of a request that ended in error (``finish_reason == "error"``)."""


class Request:
    """The state of one request while it is generated: ``prompt`` and ``out`` (token ids),
    ``logprobs``, its ``params`` and seeded ``generator`` (None without a seed), and what the
    scheduler gives it: ``blocks`` (its block table), ``row`` (its batch row while it runs)."""

    def __init__(self, index: int, prompt: list[int], params: SamplingParams, device=None):
        self.index, self.prompt, self.params = index, prompt, params
        self.generator = params.generator(device)
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text = ""                # decoded output so far (with a tokenizer)
        self.sent = 0                 # characters of `text` already streamed
        self.row: int | None = None   # its batch row while running
        self.blocks: list[int] = []
        self.cached = 0               # prompt tokens whose keys were in the cache when it was admitted
        self.end = len(prompt) + params.max_tokens   # the length at which it ends by length
        self.max_out = params.max_tokens             # output tokens at which it ends by length
        self.stop_ids = params.stop_token_ids
        self.watch_text = bool(params.stop)   # stop strings: every token may end it
        self.device_len = 0           # tokens accepted plus tokens scheduled and not handed back yet

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def length(self) -> int:
        """``len(tokens)``, without building the list (the decode loop asks for it every step)."""
        return len(self.prompt) + len(self.out)

    def fit(self, context_length: int) -> None:
        """End by length at ``context_length`` at the latest."""
        self.end = min(len(self.prompt) + self.params.max_tokens, context_length)
        self.max_out = self.end - len(self.prompt)

    def output(self, tokenizer) -> RequestOutput:
        text = None
        if tokenizer is not None and self.error is None:
            text = self.text if self.params.stop else tokenizer.decode(self.out)
        # the request's own lists, not copies: it is finished, and nothing appends to them any more
        return RequestOutput(self.index, self.prompt, self.out, text,
                             self.logprobs if self.params.logprobs and self.error is None else None,
                             self.finish_reason, self.error)


def as_token_lists(prompts, tokenizer) -> list[list[int]]:
    """``prompts`` (a list of strings, with a tokenizer, or of token id lists) as token id lists."""
    if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("prompts must be a list of prompts (strings or lists of token ids), "
                        "e.g. [prompt] for a single one")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise TypeError("text prompts need a tokenizer: pass tokenizer=... or token id lists")
            p = tokenizer.encode(p)
        try:   # operator.index: ints (numpy's and torch's too), not floats or strings
            out.append(list(map(operator.index, p)))   # (a comprehension takes twice as long)
        except TypeError:
            bad = next(t for t in p if not _is_token(t))
            raise TypeError(f"prompt {len(out)} holds {bad!r} ({type(bad).__name__}): token ids must be integers") from None
    return out


def _is_token(t) -> bool:
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def params_list(params, n: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt from ``params``: None (the defaults), one for all, or a list."""
    params = SamplingParams() if params is None else params
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (dict, str)) or not hasattr(params, "__iter__"):
        raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}"
                        + (": write SamplingParams(**params)" if isinstance(params, dict) else ""))
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    wrong = [type(p).__name__ for p in params if not isinstance(p, SamplingParams)]
    if wrong:
        raise TypeError(f"params must be SamplingParams, got {wrong[0]}"
                        + (": write SamplingParams(**params)" if wrong[0] == "dict" else ""))
    return params


# what a step hands a stream per new token: its request, the token, the text it makes decodable
Event = tuple[Request, int, str]


def finish(req: Request, context_length: int, tokenizer) -> None:
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


def text_piece(req: Request, tokenizer) -> str:
    """The newly decodable text of ``req``'s output (held back while it ends mid-character)."""
    if tokenizer is None:
        return ""
    if not req.params.stop:
        req.text = tokenizer.decode(req.out)
    text = req.text
    end = len(text) if req.finish_reason or not text.endswith("\ufffd") else len(text.rstrip("\ufffd"))
    piece, req.sent = text[req.sent:end], max(req.sent, end)
    return piece


@dataclass
class ScheduledBatch:
    """One step: a ``prefill`` of newly admitted ``requests`` (their tokens from ``cached`` on), or a
    decode step of ``requests`` (one token each; ``grown``: those given a new block for it). A decode
    batch of no requests asks the runner to hand back every step in flight."""

    prefill: bool
    requests: list[Request]
    grown: list[Request] = field(default_factory=list)


class Scheduler:
    """Waiting and running requests over the blocks of ``allocator`` (module docstring).

    ``block_size``: tokens per block; ``max_batch_size``: running requests (batch rows) at most;
    ``max_batch_tokens``: prompt tokens per prefill; ``context_length``: the model's; ``tokenizer``:
    for stop strings and streamed text (None: token ids only). ``stats``: the dict its counts go to
    (:meth:`begin`). ``finished``: the requests finished by the last :meth:`accept` calls, for the
    caller to hand out and clear."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_size: int, max_batch_tokens: int,
                 context_length: int, tokenizer=None):
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_batch_size={max_batch_size} and max_batch_tokens={max_batch_tokens} "
                             "must be positive")
        self.allocator, self.block_size = allocator, block_size
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.context_length, self.tokenizer = context_length, tokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_rows = list(range(max_batch_size - 1, -1, -1))
        self.finished: list[Request] = []
        self.unread = 0            # tokens scheduled and not handed back yet
        self.accepted = 0          # tokens the last accept() took (not dropped)
        self.events = True         # whether accept() returns events
        self.stats = self.empty_stats()

    @staticmethod
    def empty_stats() -> dict:
        return dict(prefill_tokens=0, prefill_steps=0, decode_steps=0, preemptions=0, shared_prefix_tokens=0,
                    peak_kv_blocks=0, kv_blocks_in_use=0, kv_tokens_cached=0)

    def begin(self, stats: dict, events: bool = True) -> None:
        """Count into ``stats`` from now on (its keys: :meth:`empty_stats`); ``events``: whether
        :meth:`accept` builds the per-token events (a consumer reading only ``finished`` does not)."""
        stats.update(self.empty_stats())
        self.stats, self.events, self.finished = stats, events, []

    def add(self, requests) -> None:
        """Queue ``requests`` (those already finished, e.g. refused, are skipped)."""
        for r in requests:
            if r.finish_reason is None:
                r.fit(self.context_length)
                self.waiting.append(r)

    @property
    def busy(self) -> bool:
        """Whether anything is left: requests waiting or running, or tokens not handed back."""
        return bool(self.waiting or self.running or self.unread)

    def blocks_needed(self, r: Request) -> int:
        """The KV blocks ``r`` holds at its longest."""
        return math.ceil(min(len(r.prompt) + r.params.max_tokens, self.context_length) / self.block_size)

    # ------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """The next step: a prefill if a waiting request can be admitted, else a decode step of the
        running requests (preempting the newest while blocks are short)."""
        admitted = self.admit()
        if admitted:
            return ScheduledBatch(True, admitted)
        return self.decode()

    def admit(self) -> list[Request]:
        """Take waiting requests, first come first served, while rows, blocks and the prefill token
        budget allow; give each its blocks (sharing full prefix blocks already in the cache)."""
        admitted, tokens = [], 0
        bs, alloc = self.block_size, self.allocator
        # free rows, not max_batch_size - len(running): a request that stopped keeps its row until
        # the last step in flight that still holds it is handed back
        while self.waiting and self.free_rows:
            r = self.waiting[0]
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
            self.waiting.popleft()
            r.blocks = [alloc.share(b) for b in shared]
            r.blocks += [alloc.allocate() for _ in range(math.ceil(n / bs) - len(shared))]
            for i in range(len(shared), len(keys)):
                alloc.register(r.blocks[i], keys[i])
            r.cached = len(shared) * bs
            r.row = self.free_rows.pop()
            r.device_len = n + 1               # the token this prefill samples
            admitted.append(r)
            tokens += n - r.cached
        if admitted:
            self.running.extend(admitted)
            self.unread += len(admitted)
            s = self.stats
            s["prefill_tokens"] += tokens
            s["shared_prefix_tokens"] += sum(r.cached for r in admitted)
            s["prefill_steps"] += 1
        return admitted

    def decode(self) -> ScheduledBatch:
        """The decode step of the running requests: each gets a new block where its next token
        starts one; with too few blocks, the steps in flight are asked for first (an empty batch),
        then the newest requests are preempted until the rest fit."""
        bs, alloc = self.block_size, self.allocator
        # A request whose last token by length is scheduled already sits this step out. The token fed
        # now sits at position device_len - 1; a request whose position starts a new block needs one.
        batch = [r for r in self.running if r.device_len < r.end]
        needy = [r for r in batch if (r.device_len - 1) // bs >= len(r.blocks)]
        if len(needy) > alloc.num_free:
            if self.unread:   # preempting needs every token: have the steps in flight handed back first
                return ScheduledBatch(False, [])
            while len(needy) > alloc.num_free:
                self.preempt(self.running[-1])
                batch = list(self.running)
                needy = [r for r in batch if (r.device_len - 1) // bs >= len(r.blocks)]
        for r in needy:
            r.blocks.append(alloc.allocate())
        for r in batch:
            r.device_len += 1
        s = self.stats
        used = alloc.num_used
        s["peak_kv_blocks"] = max(s["peak_kv_blocks"], used)
        s["kv_blocks_in_use"] += used            # summed over decode steps: their ratio is a time average
        s["kv_tokens_cached"] += sum(r.device_len for r in self.running) - len(batch)
        if batch:
            s["decode_steps"] += 1
            self.unread += len(batch)
        return ScheduledBatch(False, batch, needy)

    def preempt(self, r: Request) -> None:
        """Recompute preemption: free ``r``'s blocks, requeue it first, keep its tokens."""
        self.release(r)
        self.running.remove(r)
        r.device_len = r.length
        self.waiting.appendleft(r)
        self.stats["preemptions"] += 1

    def release(self, r: Request) -> None:
        """Free ``r``'s blocks and row (nothing if it holds none)."""
        for b in r.blocks:
            self.allocator.release(b)
        r.blocks = []
        if r.row is not None:
            self.free_rows.append(r.row)
            r.row = None

    def abort(self, requests) -> None:
        """Drop ``requests`` (finished or not) and everything queued: their blocks and rows are freed."""
        for r in list(requests) + self.running + list(self.waiting):
            self.release(r)
        self.waiting.clear()
        self.running.clear()
        self.unread = 0

    def accept(self, reqs: list[Request], ids: list, lps: list) -> list[Event]:
        """Append each request's token (``ids``, ``lps``: host lists, one entry per request, handed
        back in the order they were scheduled), finish and free those that are done. A request that
        finished at an earlier step (it was scheduled again before its stop token was handed back)
        drops its token here, and is freed once no later scheduled step holds it; one that finishes
        now while later steps hold it is freed when the last of them is handed back. Returns the
        ``(request, token, text piece)`` events if :meth:`begin` asked for them (else an empty
        list); counts the tokens taken in ``accepted`` and lists the finished in ``finished``.

        This loop runs once per token, so it reads only what each request keeps for it (its stop
        ids, whether it has stop strings, its output limit)."""
        events, ctx, tokenizer, done = [], self.context_length, self.tokenizer, False
        record, dropped = self.events, 0
        for r, t, lp in zip(reqs, ids, lps):
            if r.finish_reason is not None:
                r.device_len -= 1
                if r.device_len <= r.length:   # the last scheduled step that held it
                    self.release(r)
                dropped += 1
                continue
            t = int(t)
            out = r.out
            out.append(t)
            r.logprobs.append(lp)
            # finish() only for a token that may end r (most end nothing, and this runs for every token)
            if r.watch_text or t in r.stop_ids or len(out) >= r.max_out:
                finish(r, ctx, tokenizer)
                if r.finish_reason is not None:
                    done = True
                    self.finished.append(r)
                    if r.device_len <= r.length:   # no scheduled step holds it any more
                        self.release(r)
            if record:   # the text this token makes decodable, now: a later token of r may come in the same read
                events.append((r, t, text_piece(r, tokenizer)))
        if done:
            self.running[:] = [r for r in self.running if r.finish_reason is None]
        self.unread -= len(reqs)
        self.accepted = len(reqs) - dropped
        return events

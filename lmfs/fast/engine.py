"""The inference engine's speed, handed in from outside: :class:`FastRunner` and :func:`fast_engine`.

:class:`~lmfs.inference.LLM` runs each scheduled step through a model runner. The plain one
(:class:`~lmfs.inference.ModelRunner`) builds the step's batch on the host, runs
:func:`~lmfs.inference.paged_forward` and reads the sampled tokens back before the next step.
:class:`FastRunner` computes the same tokens with the device kept busy:

* **Device state.** Block tables, positions and last tokens live in device tensors indexed by the
  request's batch row; a decode step gathers them with the running rows' indices, samples on the
  device (greedy and temperature-only requests; top-k/p, min-p and repetition penalties go
  through :func:`~lmfs.inference.sample` after the forward), advances the positions and last
  tokens there too, and copies one small ``(2, B)`` tensor of ids and log-probs to the host.
* **Steps in flight** (``overlap=True``). Step ``n + 1`` needs nothing from the host that step
  ``n`` produced, so the runner launches it *before* it reads step ``n``'s tokens: the ids travel
  to pinned host memory (a ring of buffers) while the device computes, and the scheduler's
  bookkeeping of step ``n`` runs during step ``n + 1``. Up to ``in_flight`` steps stay launched
  ahead (2 by default: with one, a host that takes about as long as the device lets the device run
  dry whenever it is late; with two, a late step is made up by the next). A request that stops on
  a stop token at step ``n`` has already been fed to the steps launched after it; the scheduler
  drops those tokens. A prefill of plain (temperature-only) requests is read with the first decode
  step after it. What needs every token on the host waits for the steps in flight: a prefill, a
  preemption, repetition penalties, and MLA (whose decode batches are built on the host).
* **CUDA graphs** (GPU): the whole decode step, forward and sampling, is captured once per padded
  batch size (:func:`graph_batch_size`; padded rows read and write a dummy row and the scratch
  block) and replayed, so a step costs one launch instead of a thousand. Batches of greedy
  requests only have graphs of their own, whose bookkeeping is two kernels
  (:mod:`lmfs.kernels.engine_step`). A step that cannot be captured runs without graphs, with a
  warning. If the weights' storage changes between calls (a new dtype, new tensors), the graphs
  are captured again; weights updated in place (an optimizer step) are read by the next replay.
* **Fused forward** (``fused_decode``): decode steps and prefills run
  :class:`lmfs.kernels.decode.FusedDecode`, the same forward with the q/k/v and gate/up projections
  merged and about ten kernels a layer.
* **Autocast**: the forwards run under ``torch.autocast`` inside the step, so a CUDA graph captures
  the weights' casts and each replay casts the weights as they are then. The fused forward holds
  its projection weights in the autocast dtype instead: copies that each generation brings up to
  date before its first step, copying only the parameters updated in place since (their version
  counters tell). A replayed graph reads the copies as they are, so an update made while a
  ``stream`` is consumed reaches the next call.

Measured effects of each piece are in ``docs/performance.md``.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass

import torch

from lmfs.batching import PagedBatch, capture_graph, gathered_batch, upload
from lmfs.inference import LLM, ModelRunner, paged_attention_reference, paged_forward
from lmfs.inference.runner import no_hook, pack
from lmfs.inference.sampling import draw_uniforms, sample_scaled
from lmfs.inference.engine import FAST_OPTIONS


def graph_batch_size(n: int) -> int:
    """The batch size of the CUDA graph that runs a decode batch of ``n`` requests: 1, 2, 4, then
    the next multiple of 8 up to 256 and of 16 above. Padded rows are wasted work and every size is
    one more graph to capture: a batch of 201 pads to 208 (3% waste) where the next power of two,
    256, would waste 21%, for 35 graphs up to 256 rows instead of 9."""
    if n <= 4:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 256 else 16
    return -(-n // step) * step


def settings(reqs: list) -> tuple:
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


@dataclass
class InFlight:
    """A step launched on the device: its ``requests``, its ``(2, B)`` ``tokens`` (ids and log-probs;
    on CUDA a pinned host buffer the copy lands in once ``done`` has passed, with ``started`` for
    the device time), and whether the runner must ``wait`` for it before the next step."""

    requests: list
    tokens: torch.Tensor
    wait: bool
    started: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    prefill: bool = False          # a prefill's first tokens, read with the decode step after it


def pick_attention(config, device: torch.device, attention: str):
    """The decode attention: the Triton paged kernel or the reference (``attention``: "auto",
    "triton" or "reference"; "auto" takes the kernel on CUDA for plain attention)."""
    plain = config.attention != "mla" and config.window is None and config.attn_softcap is None
    if attention == "reference":
        return paged_attention_reference
    if attention == "triton" and not plain:
        raise ValueError("the Triton paged kernel handles plain attention only: this model uses MLA, "
                         "a sliding window or a soft-cap; use attention='reference'")
    try:
        from lmfs.kernels.paged_attention import paged_decode_attention
    except ImportError as err:
        if attention == "triton":
            raise ImportError(f"attention='triton' needs lmfs.kernels.paged_attention: {err}") from err
        return paged_attention_reference
    if attention == "auto" and not (plain and device.type == "cuda"):
        return paged_attention_reference
    return paged_decode_attention


def pick_graphs(config, device: torch.device, cuda_graphs) -> bool:
    """Whether decode steps replay CUDA graphs (``cuda_graphs``: "auto", True or False)."""
    capturable = config.attention != "mla" and config.moe_experts == 0
    if cuda_graphs is True and (device.type != "cuda" or not capturable):
        raise ValueError("cuda_graphs=True needs the model on a CUDA device, and a dense (no MoE, whose "
                         "routing syncs with the host) non-MLA model; use cuda_graphs='auto'")
    return cuda_graphs is not False and device.type == "cuda" and capturable


def pick_step_kernels(device: torch.device):
    """:mod:`lmfs.kernels.engine_step` (the decode step's bookkeeping in two kernels) on a GPU, else None."""
    if device.type != "cuda":
        return None
    try:
        from lmfs.kernels import engine_step
    except ImportError:
        return None
    return engine_step


def fused_class(model, device: torch.device, fused_decode):
    """:class:`lmfs.kernels.decode.FusedDecode` if it runs ``model`` here (``fused_decode``: "auto",
    True or False), else None."""
    if fused_decode is False or (fused_decode == "auto" and device.type != "cuda"):
        return None
    try:
        from lmfs.kernels.decode import FusedDecode
    except ImportError as err:
        if fused_decode is True:
            raise ImportError(f"fused_decode=True needs lmfs.kernels.decode.FusedDecode, which does not "
                              f"import ({err}); use fused_decode='auto' or False") from err
        return None
    reason = FusedDecode.supports(model)
    if reason is not None:
        if fused_decode is True:
            raise ValueError(f"fused_decode=True: the fused decode forward cannot run this model ({reason}); "
                             "use fused_decode='auto' or False")
        return None
    return FusedDecode


def prefill_rows(n: int, fused: bool) -> int:
    """The rows a prefill of ``n`` tokens computes: the fused forward pads them."""
    if not fused:
        return n
    from lmfs.kernels.decode import prefill_rows as padded
    return padded(n)


class DecodeGraphs:
    """The decode step ``step(rows, temperatures, uniforms)`` captured in CUDA graphs, one per
    ``(padded batch size, all greedy)``; each reads its rows, temperatures and uniforms from static
    buffers filled before a replay. ``dummy``: the row padded rows point at."""

    def __init__(self, step, device: torch.device, dummy: int):
        self.step, self.device, self.dummy = step, device, dummy
        self.graphs: dict[tuple[int, bool], tuple] = {}   # (batch size, all greedy) -> captured step
        self.filled: dict[tuple[int, bool], dict] = {}    # the batch state each graph's input buffers hold
        self.pool = None

    def clear(self) -> None:
        self.graphs.clear()
        self.filled.clear()

    def capture(self, size: int, greedy: bool) -> tuple:
        """Capture the step for ``size`` rows (all ``greedy``, or not)."""
        static_rows = torch.full((size,), self.dummy, dtype=torch.long, device=self.device)
        static_temps = torch.ones(size, device=self.device)
        static_uniforms = None if greedy else torch.full((size,), 0.5, device=self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, (static_logits, static_drawn) = capture_graph(
            lambda: self.step(static_rows, static_temps, static_uniforms), self.device, self.pool)
        return graph, static_rows, static_temps, static_uniforms, static_logits, static_drawn

    def uniforms(self, state: dict) -> torch.Tensor | None:
        """The uniforms' input buffer of the sampling graph ``state`` replays, cut to its rows (None
        without one yet), for :func:`draw_uniforms` to draw into: no separate draw and copy."""
        captured = self.graphs.get((state["size"], False))
        return None if captured is None else captured[3][:len(state["rows"])]

    def replay(self, state: dict, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Replay the graph of the batch ``state`` (capturing it first if new); None if capturing
        fails (with a warning: the caller decodes without graphs from then on)."""
        B, key = len(state["rows"]), (state["size"], uniforms is None)
        if key not in self.graphs:
            try:
                self.graphs[key] = self.capture(*key)
                self.filled.pop(key, None)
            except RuntimeError as err:   # a step that cannot be captured still decodes, only slower
                warnings.warn(f"capturing the decode step in a CUDA graph failed, decoding without graphs: {err}",
                              stacklevel=3)
                return None
        graph, static_rows, static_temps, static_uniforms, static_logits, static_drawn = self.graphs[key]
        if self.filled.get(key) is not state:   # a new batch: into the graph's buffers (the same: there already)
            static_rows.copy_(state["padded_rows"])
            static_temps.copy_(state["padded_temperatures"])
            self.filled[key] = state
        if uniforms is not None and uniforms.data_ptr() != static_uniforms.data_ptr():
            static_uniforms[:B].copy_(uniforms)   # (not drawn into it: the graph was captured just now)
        graph.replay()
        return static_logits[:B], static_drawn[:, :B]


class FastRunner(ModelRunner):
    """The model runner of :func:`fast_engine` (module docstring): the same tokens as
    :class:`~lmfs.inference.ModelRunner`, with the device kept busy.

    ``cuda_graphs``: "auto" (on for CUDA, off on the CPU), True or False; ``attention``: decode
    attention, "auto" (the Triton kernel on CUDA when importable and the model has no sliding window
    or soft-cap), "triton" or "reference"; ``fused_decode``: "auto" (the fused forward on CUDA when
    it supports the model), True (required; also on the CPU, in the Triton interpreter) or False;
    ``overlap``: launch decode steps before reading the tokens of those before (False waits for
    every step, which gives the same tokens), keeping up to ``in_flight`` steps unread."""

    def __init__(self, model, cuda_graphs="auto", attention: str = "auto", fused_decode="auto",
                 overlap: bool = True, in_flight: int = 2):
        super().__init__()
        for name, value, allowed in (("cuda_graphs", cuda_graphs, ("auto", True, False)),
                                     ("attention", attention, ("auto", "triton", "reference")),
                                     ("fused_decode", fused_decode, ("auto", True, False))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: use " + ", ".join(map(repr, allowed)))
        if in_flight < 1:
            raise ValueError(f"in_flight={in_flight}: keep at least one decode step in flight (overlap=False "
                             "waits for every step)")
        device = next(model.parameters()).device
        self.model, self.device, self.overlap, self.in_flight = model, device, bool(overlap), in_flight
        self.decode_attention = pick_attention(model.config, device, attention)
        self.cuda_graphs = pick_graphs(model.config, device, cuda_graphs)
        self._fused_class = fused_class(model, device, fused_decode)
        self._step_kernels = pick_step_kernels(device)
        self._fused = None                     # the fused forward, built in bind() (it merges the weights)
        self._forward = paged_forward
        self.dummy = 0
        self.tables = self.positions = self.last_token = None
        self._graphs = DecodeGraphs(self._step, device, 0)
        self._weights = ()                     # where the weights lived when the graphs were captured
        self._state = None                     # the decode batch's device tensors (_batch_state)
        self._pending: deque[InFlight] = deque()  # the steps in flight, oldest first, their tokens not read yet
        self._host_buffers: list[torch.Tensor] = []
        self._host_turn = 0

    def bind(self, model, cache, max_batch_size: int, autocast: torch.dtype | None) -> None:
        if model is not self.model:
            raise ValueError("FastRunner(model) runs the model it was made for: pass the same model to LLM")
        super().bind(model, cache, max_batch_size, autocast)
        if self._fused_class is not None:
            self._fused = self._forward = self._fused_forward(self._fused_class)
        # Device state, one row per running request plus a last, dummy row that padded batch rows
        # point to: its block table is all zeros (the scratch block) and its position 0.
        R, device = max_batch_size + 1, self.device
        self.dummy = self._graphs.dummy = max_batch_size
        self.tables = torch.zeros(R, self.max_blocks, dtype=torch.int32, device=device)
        self.positions = torch.zeros(R, dtype=torch.long, device=device)
        self.last_token = torch.zeros(R, dtype=torch.long, device=device)
        self._weights = self._weight_addresses()
        # On CUDA, the pinned host buffers the steps' tokens (pack: at most max_batch_size of each) are
        # copied into, used in turn: at most in_flight + 1 steps are unread at once, so a buffer is read
        # before its turn comes again
        self._host_buffers = [torch.empty(2 * max_batch_size, dtype=torch.float64, pin_memory=True)
                              for _ in range(self.in_flight + 2)] if device.type == "cuda" else []

    def _fused_forward(self, cls):
        """``cls`` (:class:`~lmfs.kernels.decode.FusedDecode`) for the model as it is now, holding its
        weights in the autocast dtype where that differs from theirs (module docstring, "Autocast")."""
        dtype = next(self.model.parameters()).dtype
        return cls(self.model, dtype=self.autocast if self.autocast not in (None, dtype) else None)

    def begin(self, stats: dict) -> None:
        super().begin(stats)
        if self.device.type == "cuda":
            stats["decode_device_seconds"] = 0.0
        self._check_weights()
        self._state = None

    def end(self, stats: dict) -> None:
        stats["fused_decode"] = self._fused is not None and stats["decode_steps"] > 0
        self._pending = deque()

    def step(self, batch, hook=None) -> list[tuple[list, list, list, bool]]:
        """Launch ``batch`` and hand back the tokens of the steps read now: a prefill reads every
        step in flight first; a decode step leaves up to ``in_flight`` steps unread."""
        hook = hook or no_hook
        if batch.prefill:
            return self._drain() + self._prefill(batch.requests, hook)
        if batch.grown:
            rows, cols, blocks = [], [], []
            for r in batch.grown:
                rows.append(r.row)
                cols.append(len(r.blocks) - 1)
                blocks.append(r.blocks[-1])
            updates = upload([rows, cols, blocks], self.device)   # one small copy
            self.tables[updates[0], updates[1]] = updates[2].to(torch.int32)
        keep = 0    # steps left in flight: none if nothing was launched or the new step must be read now
        if batch.requests:   # empty when every running request's last token is in flight
            self.stats["overlapped_steps"] += bool(self._pending)
            self._pending.append(self._launch(batch.requests, hook))
            keep = 0 if self._pending[-1].wait else self.in_flight
        return self._drain(keep)

    def _prefill(self, admitted: list, hook) -> list:
        chunks = [(r.tokens[r.cached:], r.cached, r.blocks) for r in admitted]
        batch = gathered_batch(chunks, self.block_size, self.model.config.window, self.device)
        n = batch.tokens.numel()
        with hook("prefill", n, prefill_rows(n, self._fused is not None)), self.autocast_context():
            logits = self._forward(self.model, self.cache, batch, self.decode_attention)
        # Plain requests (module docstring, "Steps in flight") are drawn as in a decode step: the
        # temperatures in one upload, nothing that waits for the forward; the others by sample().
        params, temps, generators, kinds = settings(admitted)
        plain = all(p.plain for p in kinds)
        if plain:
            uniforms = None if all(p.greedy for p in kinds) else draw_uniforms(params, generators, self.device)
            next_ids, logprobs = self._draw(logits, upload(temps, self.device, torch.float32), uniforms)
        else:
            next_ids, logprobs = self.sample(admitted, logits)
        # each admitted request's row, position and block table, in one copy that does not wait for the forward
        state = upload([[r.row, r.length] + r.blocks + [0] * (self.max_blocks - len(r.blocks)) for r in admitted],
                       self.device)
        rows = state[:, 0]
        self.tables[rows] = state[:, 2:].to(torch.int32)
        self.positions[rows] = state[:, 1]
        self.last_token[rows] = next_ids
        self._state = None                     # rows were handed to new requests
        drawn = pack(next_ids, logprobs)
        if plain and self.overlap and self.model.config.attention != "mla":
            # the first tokens are read with the next decode step, launched before them (its inputs are
            # on the device already); MLA's decode batches are built from the host's tokens
            self._pending.append(self._in_flight(admitted, drawn, wait=False, prefill=True))
            return []
        return [(admitted, *drawn.tolist(), True)]

    def _launch(self, batch: list, hook) -> InFlight:
        """Start the decode step of ``batch`` on the device and the copy of its tokens to the host,
        without waiting for either."""
        cuda = self.device.type == "cuda"
        started = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            started.record()
        if self.model.config.attention == "mla":   # latents: the gathered path, built from the host's tokens
            pb = self.decode_batch(batch)
            with hook("decode", len(batch), len(batch)), self.autocast_context():
                logits = paged_forward(self.model, self.cache, pb)
            drawn, wait = pack(*self.sample(batch, logits)), True
        else:
            state = self._batch_state(batch)
            uniforms = None
            if state["plain"] and not state["greedy"]:
                out = self._graphs.uniforms(state) if self.cuda_graphs else None
                uniforms = draw_uniforms(state["params"], state["generators"], self.device, out=out)
            width = None if self.cuda_graphs else max(len(r.blocks) for r in batch)
            with hook("decode", len(state["rows"]), state["size"]):
                logits, drawn = self._decode_step(state, uniforms, width)
            if not state["plain"]:   # filters or penalties: sample from the logits
                next_ids, logprobs = self.sample(batch, logits)
                self.last_token[state["rows"]] = next_ids
                drawn = pack(next_ids, logprobs)
            wait = state["host_tokens"] or not self.overlap
        return self._in_flight(batch, drawn, wait, started=started)

    def _in_flight(self, requests: list, drawn: torch.Tensor, wait: bool, prefill: bool = False,
                   started: torch.cuda.Event | None = None) -> InFlight:
        """The step whose ``(2, B)`` ``drawn`` ids and log-probs the host reads later: on CUDA copied
        into pinned host memory (so the copy does not block the host), with an event recorded after it."""
        if self.device.type != "cuda":
            return InFlight(requests, drawn, wait, prefill=prefill)
        # the next pinned host buffer in turn (pinning a tensor for every step costs the host about
        # twice the copy itself)
        buffer = self._host_buffers[self._host_turn]
        self._host_turn = (self._host_turn + 1) % len(self._host_buffers)
        host = buffer[:drawn.numel()].view(drawn.shape)
        host.copy_(drawn, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        return InFlight(requests, host, wait, started, done, prefill)

    def _drain(self, keep: int = 0) -> list:
        """Read the oldest steps in flight until ``keep`` are left (none: afterwards the host knows
        every token); their ``(requests, ids, logprobs, prefill)``."""
        s, read = self.stats, []
        while len(self._pending) > keep:
            step = self._pending.popleft()
            if step.done is not None:
                start = time.perf_counter()
                step.done.synchronize()
                s["decode_wait_seconds"] += time.perf_counter() - start
                if not step.prefill:
                    s["decode_device_seconds"] += step.started.elapsed_time(step.done) / 1e3
            read.append((step.requests, *step.tokens.tolist(), step.prefill))
        return read

    def _batch_state(self, batch: list) -> dict:
        """The decode batch as device tensors, rebuilt only when its rows changed: its ``rows``,
        ``temperatures`` (0 for greedy), whether every request is ``plain`` (sampled inside the step)
        or ``greedy``, whether any needs the tokens on the host (``host_tokens``: a repetition
        penalty), its ``params`` and ``generators``; with CUDA graphs the same padded to the graph's
        batch size (:func:`graph_batch_size`; ``padded_rows`` point at the dummy row)."""
        rows = [r.row for r in batch]
        if self._state is not None and self._state["row_list"] == rows:
            return self._state
        params, temps, generators, kinds = settings(batch)
        state = dict(row_list=rows, params=params, generators=generators, size=len(rows),
                     plain=all(p.plain for p in kinds), greedy=all(p.greedy for p in kinds),
                     host_tokens=any(p.repetition_penalty != 1 for p in kinds))
        if self.cuda_graphs:
            state["size"] = size = graph_batch_size(len(rows))
            rows, temps = rows + [self.dummy] * (size - len(rows)), temps + [0.0] * (size - len(rows))
        # rows and temperatures in one upload (float64 holds every row index exactly)
        both = upload([rows, temps], self.device, torch.float64)
        state["padded_rows"], state["padded_temperatures"] = both[0].long(), both[1].float()
        state["rows"] = state["padded_rows"][:len(batch)]
        self._state = state
        return state

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
        with self.autocast_context():   # inside the step, so that a CUDA graph captures the weights' casts
            logits = self._forward(self.model, self.cache, self._decode_batch(rows, width), self.decode_attention)
        if uniforms is None and self._step_kernels is not None:   # greedy, on a GPU: draw and advance in one kernel
            return logits, self._step_kernels.greedy_advance(logits, rows, self.last_token, self.positions, self.dummy)
        next_ids, logprobs = self._draw(logits, temperatures, uniforms)
        self.last_token[rows] = next_ids
        self.positions[rows] += 1
        # padded rows wrote here: keep the dummy row at position 0 (zero_ on a view, since indexing with
        # a Python int and assigning a number copies from the host, which a CUDA graph cannot capture)
        self.positions.narrow(0, self.dummy, 1).zero_()
        return logits, pack(next_ids, logprobs)

    @staticmethod
    def _draw(logits: torch.Tensor, temperatures: torch.Tensor,
              uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The draw of plain requests on the device, as :func:`~lmfs.inference.sample` draws them:
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
        skip the inverse-CDF draw."""
        if self.cuda_graphs:
            out = self._graphs.replay(state, uniforms)
            if out is not None:
                self.stats["cuda_graphs"] = True
                return out
            self.cuda_graphs = False   # (width stays None: the tables' full width)
        return self._step(state["rows"], state["padded_temperatures"][:len(state["rows"])], uniforms, width)

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


def fast_engine(model, tokenizer=None, **kwargs) -> LLM:
    """:class:`~lmfs.inference.LLM` with a :class:`FastRunner`: the same scheduler and the same
    tokens, with CUDA graphs, steps in flight and the fused forward. ``kwargs``: the runner's options
    (``cuda_graphs``, ``attention``, ``fused_decode``, ``overlap``, ``in_flight``) and the engine's."""
    options = {k: kwargs.pop(k) for k in FAST_OPTIONS if k in kwargs}
    return LLM(model, tokenizer, runner=FastRunner(model, **options), **kwargs)

"""Pipeline parallelism: consecutive layers on consecutive ranks, activations passed along.

Stage ``s`` of ``p`` holds a contiguous run of blocks (the first stage also the embedding, the
last the final norm, head and loss). Forward sends activations ``s -> s+1``; backward sends their
gradients ``s+1 -> s``; point-to-point only, and only at the ``p - 1`` boundaries.

A single batch would keep one stage busy at a time. Cutting it into ``m`` micro-batches lets
the stages work on different micro-batches at once. The schedules here:

* ``naive``: the whole batch as one micro-batch (``m = 1``): only one stage ever works.
* ``gpipe`` (Huang et al., 2019): all ``m`` forwards, then all ``m`` backwards. Every stage
  keeps the activations of all ``m`` micro-batches until their backward.
* ``1f1b`` (PipeDream-Flush, Narayanan et al., 2021): after ``p - s - 1`` warm-up forwards, stage
  ``s`` alternates one forward and one backward, so it holds at most ``p - s`` micro-batches of
  activations instead of ``m``. The bubble is the same as GPipe's.

The bubble. Take equal forward time ``F`` and backward time ``B`` on every stage and free
communication. The last stage starts its first forward only after ``p - 1`` forwards upstream,
and the first stage finishes its last backward ``p - 1`` backwards after the last stage's, so a
step lasts ``(m + p - 1)(F + B)`` while each rank works ``m(F + B)`` of it. Two ways to state it:

* **bubble-to-work ratio** (the syllabus's ``(p - 1)/m``): idle time / busy time ``= (p - 1)/m``;
* **bubble fraction** of the step: idle time / total time ``= (p - 1)/(m + p - 1)``.

:func:`bubble` measures both from the recorded timelines. Gradients of the micro-batches add
up before the optimizer step, so every schedule computes exactly the gradient of the full batch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.parallel import comm
from lmfs.parallel.common import build_model, train_on_rank
from lmfs.parallel.launch import device_for

SCHEDULES = ("naive", "gpipe", "1f1b")


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, as-equal-as-possible runs of layers; earlier stages get the extra ones."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages for {n_layers} layers: every stage needs a "
                         f"layer, so use at most {n_layers} stages (or a deeper model)")
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` cut out of a full :class:`lmfs.nn.TransformerLM`.

    ``forward`` maps token ids ``(B, T)`` (first stage) or activations ``(B, T, d)`` to
    activations, or to logits on the last stage. With tied embeddings and more than one stage,
    the last stage holds its own copy of the embedding matrix as the head; :func:`train_pipeline`
    keeps the two copies equal by summing their gradients.
    """

    def __init__(self, model: TransformerLM, stage: int, n_stages: int):
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.config = model.config
        self.layers = split_layers(len(model.blocks), n_stages)[stage]
        self.blocks = nn.ModuleList(model.blocks[i] for i in self.layers)
        if self.first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        if self.last:
            self.final_norm = model.final_norm
            self.lm_head = model.lm_head
            self.tied_head = None
            if model.lm_head is None:
                self.tied_head = (model.tok_emb.weight if self.first
                                  else nn.Parameter(model.tok_emb.weight.detach().clone()))
        self.loss = model.loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            ids = x
            x = self.tok_emb(ids)
            if self.pos_emb is not None:
                x = x + self.pos_emb(ids.shape[1])
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x
        if self.final_norm is not None:
            x = self.final_norm(x)
        logits = x @ self.tied_head.T if self.lm_head is None else self.lm_head(x)
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def original_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters under their names in the full model."""
        state = {}
        for j, i in enumerate(self.layers):
            state |= {f"blocks.{i}.{k}": v for k, v in self.blocks[j].state_dict().items()}
        if self.first:
            state |= {f"tok_emb.{k}": v for k, v in self.tok_emb.state_dict().items()}
            if self.pos_emb is not None:
                state |= {f"pos_emb.{k}": v for k, v in self.pos_emb.state_dict().items()}
        if self.last:
            if self.final_norm is not None:
                state |= {f"final_norm.{k}": v for k, v in self.final_norm.state_dict().items()}
            if self.lm_head is not None:
                state |= {f"lm_head.{k}": v for k, v in self.lm_head.state_dict().items()}
            elif not self.first:
                state["tok_emb.weight"] = self.tied_head.detach()
        return {k: v.detach().clone() for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# Point-to-point between neighbouring stages


class StageLinks:
    """Sends and receives between stage ``s`` and its neighbours ``s - 1`` and ``s + 1``.

    Every message has the activation shape, so receivers can allocate before the data arrives.
    The paired operations (send an activation forward while receiving a gradient back, and the
    reverse) are posted together with ``batch_isend_irecv``; posting them one after the other
    could deadlock, with both neighbours blocked in a send that waits for the other's receive.
    On the first (last) stage everything towards the missing neighbour is a no-op.
    """

    def __init__(self, stage: int, n_stages: int, shape, dtype, device):
        self.prev = stage - 1 if stage > 0 else None
        self.next = stage + 1 if stage < n_stages - 1 else None
        self.shape, self.dtype, self.device = shape, dtype, device

    def _exchange(self, send=None, send_to=None, recv_from=None):
        ops, got = [], None
        if send is not None and send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), send_to))
        if recv_from is not None:
            got = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got, recv_from))
        if ops:
            for work in comm.batch_isend_irecv(ops):
                work.wait()
        return got

    def recv_forward(self):
        return self._exchange(recv_from=self.prev)

    def send_forward(self, y):
        self._exchange(send=y, send_to=self.next)

    def recv_backward(self):
        return self._exchange(recv_from=self.next)

    def send_backward(self, g):
        self._exchange(send=g, send_to=self.prev)

    def send_forward_recv_backward(self, y):
        """Both with the next stage: ``y`` goes out, the gradient of an earlier output comes back."""
        if self.next is None:
            return None
        return self._exchange(send=y, send_to=self.next, recv_from=self.next)

    def send_backward_recv_forward(self, g):
        """Both with the previous stage: ``g`` goes back, the next micro-batch's input comes in."""
        if self.prev is None:
            return None
        return self._exchange(send=g, send_to=self.prev, recv_from=self.prev)


# ---------------------------------------------------------------------------------------------
# Schedules. ``work.forward(i, x)`` returns what to send on (None on the last stage);
# ``work.backward(i, g)`` returns the gradient to send back (None on the first stage).


class Clock:
    """Timestamps in seconds since :meth:`start`: CUDA events on a GPU, wall clock on a CPU.

    Events are recorded on the GPU stream in program order, so they time the kernels without
    forcing a synchronisation at every mark; :meth:`seconds` synchronises once at the end.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def start(self):
        self.t0 = self.mark()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, mark) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return self.t0.elapsed_time(mark) / 1e3
        return mark - self.t0


def _timed(events: list, clock: Clock, kind: str, i: int, fn, arg):
    start = clock.mark()
    out = fn(i, arg)
    events.append((kind, i, start, clock.mark()))
    return out


def gpipe_schedule(work, links: StageLinks, m: int, clock: Clock) -> list:
    """All forwards (in order), then all backwards (last micro-batch first)."""
    events = []
    for i in range(m):
        links.send_forward(_timed(events, clock, "F", i, work.forward, links.recv_forward()))
    for i in reversed(range(m)):
        links.send_backward(_timed(events, clock, "B", i, work.backward, links.recv_backward()))
    return events


def one_f_one_b_schedule(work, links: StageLinks, m: int, clock: Clock) -> list:
    """Warm-up forwards, then one forward / one backward alternately, then the last backwards.

    Stage ``s`` runs ``p - s - 1`` warm-up forwards: exactly enough that, when its first backward
    is due, the gradient from the stages after it is on its way.
    """
    events = []
    warmup = min(work.n_stages - work.stage - 1, m)
    for i in range(warmup):
        links.send_forward(_timed(events, clock, "F", i, work.forward, links.recv_forward()))
    steady = m - warmup
    x = links.recv_forward() if steady else None
    for k in range(steady):
        y = _timed(events, clock, "F", warmup + k, work.forward, x)
        g = links.send_forward_recv_backward(y)
        gx = _timed(events, clock, "B", k, work.backward, g)
        if k == steady - 1:
            links.send_backward(gx)
        else:
            x = links.send_backward_recv_forward(gx)
    for k in range(steady, m):
        links.send_backward(_timed(events, clock, "B", k, work.backward, links.recv_backward()))
    return events


def run_schedule(schedule: str, work, links: StageLinks, m: int, clock: Clock) -> list:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {SCHEDULES}")
    if schedule == "1f1b":
        return one_f_one_b_schedule(work, links, m, clock)
    return gpipe_schedule(work, links, m, clock)


class StageWork:
    """Forward and backward of one stage on micro-batches of a global batch ``(x, y)``.

    The last stage's loss per micro-batch is divided by ``m``: the micro-batch gradients then
    sum to the gradient of the batch's mean loss. ``max_in_flight`` counts the most micro-batches
    whose activations were held at once, the schedules' memory difference.
    """

    def __init__(self, stage: PipelineStage, x: torch.Tensor, y: torch.Tensor, m: int):
        if x.shape[0] % m:
            raise ValueError(f"batch size {x.shape[0]} does not split into {m} micro-batches")
        self.module, self.m = stage, m
        self.stage, self.n_stages = stage.stage, stage.n_stages
        self.xs, self.ys = x.chunk(m), y.chunk(m)
        self.inputs, self.outputs, self.losses = {}, {}, []
        self.max_in_flight = 0

    def forward(self, i: int, received):
        if self.module.first:
            inp = self.xs[i]
        else:  # a leaf that will receive the gradient to send back
            inp = received.requires_grad_()
        out = self.module(inp)
        self.inputs[i] = inp
        self.max_in_flight = max(self.max_in_flight, len(self.inputs))
        if self.module.last:
            loss = self.module.loss(out, self.ys[i]) / self.m
            self.losses.append(loss.detach())  # no .item(): it would stall a GPU pipeline here
            self.outputs[i] = loss
            return None
        self.outputs[i] = out
        return out.detach()

    def backward(self, i: int, grad):
        out, inp = self.outputs.pop(i), self.inputs.pop(i)
        if self.module.last:
            out.backward()
        else:
            out.backward(grad)
        return None if self.module.first else inp.grad


def _sync_tied_head(stage: PipelineStage):
    """First and last stage each hold the tied embedding; sum their gradients so both step alike."""
    if not stage.config.tie_embeddings or stage.n_stages == 1 or not (stage.first or stage.last):
        return
    mine = stage.tok_emb.weight if stage.first else stage.tied_head
    peer = stage.n_stages - 1 if stage.first else 0
    theirs = torch.empty_like(mine.grad)
    for work in comm.batch_isend_irecv([dist.P2POp(dist.isend, mine.grad, peer),
                                        dist.P2POp(dist.irecv, theirs, peer)]):
        work.wait()
    mine.grad += theirs


def bubble(timelines: list[list], micro_batches: int) -> dict:
    """Measured idle share of a step from per-rank timelines, next to the formulas.

    ``timelines[r]`` is rank ``r``'s list of ``(kind, micro_batch, start_s, end_s)``.
    """
    p = len(timelines)
    start = min(e[2] for t in timelines for e in t)
    span = max(e[3] for t in timelines for e in t) - start
    busy = sum(e[3] - e[2] for t in timelines for e in t)
    idle = p * span - busy
    return {"measured_fraction": idle / (p * span),
            "formula_fraction": (p - 1) / (micro_batches + p - 1),
            "measured_bubble_to_work": idle / busy,
            "formula_bubble_to_work": (p - 1) / micro_batches,
            "step_seconds": span}


def plot_timeline(timelines: list[list], ax=None, title: str = ""):
    """Draw each rank's forwards (light) and backwards (dark) as bars, micro-batch numbers inside."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.5 * len(timelines)))
    t0 = min(e[2] for t in timelines for e in t)
    colors = {"F": "#9ecae1", "B": "#3182bd"}
    for rank, events in enumerate(timelines):
        for kind, i, a, b in events:
            ax.broken_barh([((a - t0) * 1e3, (b - a) * 1e3)], (rank - 0.4, 0.8), color=colors[kind],
                           edgecolor="black", linewidth=0.5)
            ax.text((a + b - 2 * t0) / 2 * 1e3, rank, f"{kind}{i}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(timelines)), [f"stage {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    return ax


def train_pipeline(rank: int, world_size: int, config: TransformerConfig, batches, schedule: str = "1f1b",
                   micro_batches: int = 4, optimizer_class=torch.optim.AdamW,
                   optimizer_kwargs: dict | None = None, seed: int = 0) -> dict:
    """Rank function: rank ``r`` is stage ``r``; every rank gets the same global ``batches``.

    Returns what :func:`lmfs.parallel.common.train_on_rank` returns (the state: this stage's
    parameters under their full-model names), plus the last step's ``timeline`` and
    ``max_in_flight``, the most micro-batches whose activations this stage held at once.
    """
    if schedule == "naive":
        micro_batches = 1
    device = device_for(rank)
    full = build_model(config, seed, device)
    stage = PipelineStage(full, rank, world_size)
    del full  # a real pipeline never builds the other stages' layers
    opt = optimizer_class(stage.parameters(), **(optimizer_kwargs or {}))
    clock = Clock(device)
    last = {}  # the last step's schedule, for the timeline

    def step(batch):
        x, y = (t.to(device) for t in batch)
        work = StageWork(stage, x, y, micro_batches)
        shape = (x.shape[0] // micro_batches, x.shape[1], config.d_model)
        links = StageLinks(rank, world_size, shape, next(stage.parameters()).dtype, device)
        dist.barrier()  # line the ranks' clocks up at the start of the step
        clock.start()
        last["events"] = run_schedule(schedule, work, links, micro_batches, clock)
        last["work"] = work
        _sync_tied_head(stage)
        # Only the last stage has a loss: it contributes all of it.
        return sum(work.losses) if stage.last else torch.zeros((), device=device)

    out = train_on_rank(stage, opt, batches, step, device, final_state=stage.original_state)
    out["timeline"] = [(kind, i, clock.seconds(a), clock.seconds(b)) for kind, i, a, b in last["events"]]
    out["max_in_flight"] = last["work"].max_in_flight
    return out


class _SleepWork:
    """Stand-in stage work that sleeps ``forward_s``/``backward_s`` instead of computing."""

    def __init__(self, stage: int, n_stages: int, shape, forward_s: float, backward_s: float):
        self.stage, self.n_stages, self.shape = stage, n_stages, shape
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, i, received):
        time.sleep(self.forward_s)
        return None if self.stage == self.n_stages - 1 else torch.zeros(self.shape)

    def backward(self, i, grad):
        time.sleep(self.backward_s)
        return None if self.stage == 0 else torch.zeros(self.shape)


def simulate_pipeline(rank: int, world_size: int, schedule: str = "1f1b", micro_batches: int = 4,
                      forward_ms: float = 20, backward_ms: float = 40) -> list:
    """Rank function: the real schedule and messages, with each F/B replaced by a fixed sleep.

    Equal, noise-free stage times are the formula's assumption, so this shows the bubble itself
    (on a busy CPU, real compute would mostly show the processes competing for cores). Launch it
    with ``run(simulate_pipeline, p, ..., backend="gloo")``: the sleeps happen on the CPU, so
    the receives must block the CPU too. Returns this rank's timeline.
    """
    if dist.get_backend() != "gloo":
        raise ValueError("simulate_pipeline times CPU sleeps and needs blocking receives: launch it "
                         "with run(simulate_pipeline, ..., backend='gloo')")
    if schedule == "naive":
        micro_batches = 1
    shape = (1, 8)
    work = _SleepWork(rank, world_size, shape, forward_ms / 1e3, backward_ms / 1e3)
    links = StageLinks(rank, world_size, shape, torch.float32, torch.device("cpu"))
    clock = Clock("cpu")
    dist.barrier()
    clock.start()
    events = run_schedule(schedule, work, links, micro_batches, clock)
    return [(kind, i, clock.seconds(a), clock.seconds(b)) for kind, i, a, b in events]


def bubble_sweep(rank: int, world_size: int, schedules=("gpipe", "1f1b"), micro_batches=(1, 2, 4, 8),
                 forward_ms: float = 20, backward_ms: float = 40) -> dict:
    """Rank function: :func:`simulate_pipeline` for every schedule and micro-batch count.

    Returns ``{schedule: {m: this rank's timeline}}``; feed ``[t[s][m] for t in results]`` to
    :func:`bubble` or :func:`plot_timeline`. Launch with ``backend="gloo"``, as for
    :func:`simulate_pipeline`.
    """
    return {s: {m: simulate_pipeline(rank, world_size, s, m, forward_ms, backward_ms) for m in micro_batches}
            for s in schedules}

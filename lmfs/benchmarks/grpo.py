"""One GRPO step: where its time goes, and lmfs's trainer vs TRL's ``GRPOTrainer``.

    python -m lmfs.benchmarks grpo [--json results/h200/grpo.json] [--tiny] [--steps N] [--no-trl]
                                   [--autocast off] [--no-fused-update] [--packed-update]
                                   [--compile-update] [--no-overlap-steps] [--no-sequential] [--profile]

Both trainers run the same task (the held-out-free train split of the course's arithmetic problems,
in the chat template of :mod:`lmfs.alignment.sft`, rewarded by
:func:`~lmfs.alignment.tasks.check_answer`), the same Llama-shaped model (random weights: the
time of a step does not depend on what the weights learned; lmfs's copy is exported to
``LlamaForCausalLM`` with :func:`lmfs.nn.to_hf_llama`, the tokenizer with
:func:`lmfs.tokenization.hf.hf_tokenizer`), the same batch (``prompts × group_size`` sequences per
step, all generated at once and then used for one optimizer step, micro-batches of the same size in
the update: on a GPU one micro-batch of the whole batch, TRL's ``per_device_train_batch_size``), the
same sampling (temperature 1, no filters, stopping at ``<|end|>`` only) and generation limit, no
KL penalty (so neither runs a reference model), one epoch per batch (so neither needs old
log-probs), fp32 weights (bf16 autocast on CUDA: lmfs's update and rollouts both compute
under it, ``--autocast off`` computes lmfs's in fp32). lmfs's trainer is the fast path,
:class:`lmfs.fast.grpo.PipelinedGRPOTrainer`; its :class:`~lmfs.fast.grpo.PipelineConfig` options:
``--no-fused-update`` trains through the plain modules instead of
:func:`lmfs.kernels.fused.fuse_model`'s; ``--packed-update`` runs the update on the sequences packed
into one row instead of right-padded; ``--compile-update`` runs it through ``torch.compile``,
compiled in the warm-up; ``--profile``
then runs one more step under the profiler and prints, per part of the step, its host time and the
GPU's busy time in it, and the longest stretches the GPU sat idle with what the host did then). A random
model seldom produces its stop token, so most responses run to the limit in both: equal work; the
mean response lengths are printed to show it. The engine's flags (CUDA graphs, fused decode, autocast) are printed with
lmfs's row, and where the step goes: the rollout's decode device time against its wall time (the
rest is the host's work and waits), how many decode steps were launched while an earlier one was
in flight, and the update's time per micro-batch (the update without its optimizer step, divided
by the micro-batches) and of the optimizer step. Why one micro-batch on a GPU: at this model's size a
micro-batch's forward and backward are bound by the host's launches (about 12 ms of kernels in 75 ms
of wall time at 64 sequences), so its wall time hardly grows with its rows and the update's time
grows with the number of micro-batches; 256 sequences of up to 256 tokens fit in memory easily.

(a) **Useful generation share** of a GRPO step: the time of the engine's model passes on real
    tokens, divided by the step's wall time. Each prefill forward and each decode step (forward and
    draw, on the device) of :class:`lmfs.inference.LLM` is timed (CUDA events on a GPU, so it is
    device time; wall time on the CPU) and scaled by ``real rows / computed rows``: decode batches
    captured in CUDA graphs are padded to the graphs' sizes, the fused prefill's matmuls to
    :func:`~lmfs.kernels.decode.prefill_rows`, and padded rows are waste. (A prefill forward's
    device time runs from its first launch to its last kernel, so it includes the gaps where the
    device waits for the host's launches; ``--profile`` shows how busy the device really was.) Not counted
    as useful: padding, scheduling and the host's waits, detokenising, rewards, the reference and
    the update. The rollout's share of the step and the useful share of the rollout are printed too,
    the step's time outside the trainer's phases ("between"), and Python's garbage collections
    in the timed steps (they stop the host in whichever phase an allocation triggers them).
    Goal on one H200: ≥ 70%.
The timed steps run in one ``train`` call, so that each step may start the next one's rollout
while the device finishes its update (``PipelineConfig.overlap_steps``; ``--no-overlap-steps`` turns
it off); the trainer's phase timer counts the host's time in such a start-up in the rollout phase.

(b) **Samples per second** (sequences per step / seconds per step, after warm-up steps) of lmfs's
    pipelined trainer and of TRL's ``GRPOTrainer`` (which generates with Hugging Face ``generate``:
    static batches padded to their longest member). Goal: ≥ 2×.

(c) **The sequential step**: samples per second of :class:`~lmfs.alignment.grpo.GRPOTrainer`, the
    trainer as lecture 17 teaches it (plain modules, lmfs's AdamW, each phase after the one before),
    on a fresh copy of the same weights, as a ratio of the pipelined trainer's (``--no-sequential``
    leaves it out). Goal: ≥ 0.5×.

Without a GPU (or with ``--tiny``) a tiny model runs both on the CPU in one run, to exercise the
code (a test does); those numbers say little about a GPU. When TRL cannot be imported or fails,
its row says why and lmfs's figures stand alone.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass

import torch

from lmfs.bench import error_line, save_json


@dataclass(frozen=True)
class Sizes:
    d_model: int
    n_layers: int
    n_heads: int
    context_length: int
    prompts: int          # prompts per step
    group_size: int       # answers per prompt
    max_new_tokens: int
    micro_batch: int      # sequences per forward/backward in the update (TRL: per_device_train_batch_size)
    steps: int            # timed steps (after the warm-up)


GPU_SIZES = Sizes(d_model=512, n_layers=8, n_heads=8, context_length=512, prompts=32, group_size=8,
                  max_new_tokens=256, micro_batch=256, steps=3)
CPU_SIZES = Sizes(d_model=64, n_layers=2, n_heads=4, context_length=128, prompts=4, group_size=4,
                  max_new_tokens=24, micro_batch=8, steps=2)


class Stopwatch:
    """Times the calls made through it: CUDA events around each call on a GPU (device time, and no
    wait added), wall time on the CPU. ``seconds`` sums them (on a GPU after waiting for the device)."""

    def __init__(self, cuda: bool):
        self.cuda, self.events = cuda, []

    def __call__(self, fn, *args, **kwargs):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events.append((start, end))
        else:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.events.append(time.perf_counter() - start)
        return out

    @property
    def seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        return sum(self.events)


class GcTimer:
    """Python's garbage collections while it runs (``gc.callbacks``): how many, per generation, and
    their seconds. A collection stops the host wherever an allocation triggers it."""

    def __init__(self):
        self.collections, self.seconds, self._start = {0: 0, 1: 0, 2: 0}, 0.0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


class ForwardTimer:
    """Times the model forwards of an :class:`~lmfs.inference.LLM` and counts real vs computed rows.

    Installs itself as the engine's ``forward_hook``, which the model runner enters around each
    forward it launches: a decode step (the forward and the draw for every running request, on the
    device, replayed from a CUDA graph on a GPU; computed rows include the graph's padding) and a
    prefill (its packed prompt tokens; the fused forward pads their rows). Only instruments: the
    engine computes exactly what it would without it.
    """

    def __init__(self, llm):
        if llm.forward_hook is not None:
            raise RuntimeError("the engine already has a forward_hook: close the other timer first")
        self.llm, self.cuda = llm, llm.device.type == "cuda"
        self.reset()
        llm.forward_hook = self.hook

    def close(self) -> None:
        if self.llm.forward_hook == self.hook:
            self.llm.forward_hook = None

    def reset(self) -> None:
        # per kind of forward: its timed calls, and its real and computed rows
        self.watches = {kind: Stopwatch(self.cuda) for kind in ("decode", "prefill")}
        self.rows = {kind: [0, 0] for kind in self.watches}

    @property
    def events(self) -> list:
        return [e for watch in self.watches.values() for e in watch.events]

    @property
    def real_rows(self) -> int:
        return sum(real for real, _ in self.rows.values())

    def hook(self, kind: str, real: int, computed: int) -> "ForwardTimer.Timed":
        """The engine's ``forward_hook``: counts the rows; the context it returns times the forward."""
        rows = self.rows[kind]
        rows[0] += real
        rows[1] += computed
        return self.Timed(self.watches[kind])

    class Timed:
        """One forward timed into ``watch`` (a :class:`Stopwatch`) as one of its calls: CUDA events
        around it on a GPU, wall time on the CPU."""

        def __init__(self, watch: "Stopwatch"):
            self.watch, self.start = watch, None

        def __enter__(self):
            if self.watch.cuda:
                self.start = torch.cuda.Event(enable_timing=True)
                self.start.record()
            else:
                self.start = time.perf_counter()

        def __exit__(self, *exc):
            if self.watch.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.watch.events.append((self.start, end))
            else:
                self.watch.events.append(time.perf_counter() - self.start)

    def breakdown(self) -> dict:
        """Per kind of forward (``decode``, ``prefill``): its timed ``seconds``, ``rows`` (real) and
        ``computed_rows``, and ``useful_seconds``, the seconds scaled by real / computed rows."""
        out = {}
        for kind, watch in self.watches.items():
            seconds, (real, computed) = watch.seconds, self.rows[kind]
            out[kind] = dict(seconds=seconds, rows=real, computed_rows=computed,
                             useful_seconds=seconds * real / max(computed, 1))
        return out

    def useful_seconds(self) -> float:
        return sum(part["useful_seconds"] for part in self.breakdown().values())


def make_setup(sizes: Sizes, device: torch.device):
    """The tokenizer (bytes + the chat template's special tokens), a random model and the problems."""
    from lmfs.alignment.sft import SPECIAL_TOKENS
    from lmfs.alignment.tasks import load_split
    from lmfs.nn import TransformerConfig, TransformerLM
    from lmfs.tokenization import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], list(SPECIAL_TOKENS))
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=tok.vocab_size, context_length=sizes.context_length, d_model=sizes.d_model,
                               n_layers=sizes.n_layers, n_heads=sizes.n_heads)
    model = TransformerLM(config).to(device)
    return tok, model, load_split("arithmetic", "train")


class OptimizerTimer:
    """Seconds of the trainer's optimizer steps (:class:`Stopwatch`: on a GPU device time, and no wait
    added, since the trainer queues the step without waiting for the device)."""

    def __init__(self, optimizer, device: torch.device):
        self.optimizer, self.watch = optimizer, Stopwatch(device.type == "cuda")
        step = optimizer.step
        optimizer.step = lambda *args, **kwargs: self.watch(step, *args, **kwargs)

    def close(self) -> None:
        del self.optimizer.step


class RolloutRecorder:
    """Sums the engine's statistics of every rollout the trainer finishes, and counts the rollouts
    started during the update of the step before (:class:`~lmfs.fast.grpo.PipelinedGRPOTrainer`'s
    ``overlap_steps``) with the host's seconds in their start-up (which the trainer's phase timer
    counts in the rollout phase)."""

    def __init__(self, trainer):
        self.trainer, self._update, self._rollout_of = trainer, trainer.update, trainer.rollout_of
        self._start = getattr(trainer, "start_rollout", None)
        self.stats = dict.fromkeys(ROLLOUT_STATS, 0.0)
        self.early, self.early_seconds, self._in_update = 0, 0.0, False

        def start_rollout(*args, **kwargs):
            begin = time.perf_counter()
            out = self._start(*args, **kwargs)
            if self._in_update:
                self.early += 1
                self.early_seconds += time.perf_counter() - begin
            return out

        def rollout_of(*args, **kwargs):
            out = self._rollout_of(*args, **kwargs)
            for key in ROLLOUT_STATS:
                self.stats[key] += trainer.rollout_stats.get(key) or 0.0   # None: no device time off CUDA
            return out

        def update(*args, **kwargs):
            self._in_update = True
            try:
                return self._update(*args, **kwargs)
            finally:
                self._in_update = False

        trainer.rollout_of, trainer.update = rollout_of, update
        if self._start is not None:
            trainer.start_rollout = start_rollout

    def reset(self) -> None:
        self.stats = dict.fromkeys(ROLLOUT_STATS, 0.0)
        self.early, self.early_seconds = 0, 0.0

    def close(self) -> None:
        del self.trainer.rollout_of, self.trainer.update
        if self._start is not None:
            del self.trainer.start_rollout


# The engine's statistics of a rollout that say where its time went (summed over the timed steps).
ROLLOUT_STATS = ("prefill_seconds", "decode_seconds", "decode_device_seconds", "decode_wait_seconds",
                 "decode_steps", "overlapped_steps")


def run_lmfs(model, tok, problems, sizes: Sizes, autocast: str = "auto", fused_update: bool = True,
             packed_update: bool = False, profile: bool = False, overlap_steps: bool = True,
             compile_update: bool = False) -> dict:
    """Time ``sizes.steps`` GRPO steps of lmfs's trainer after warming up (two steps on a GPU, where the
    decode step is captured in a CUDA graph for each batch size met, one on the CPU); with ``profile``,
    then one more step under the profiler (:func:`profile_step`)."""
    from lmfs.alignment.grpo import PHASES
    from lmfs.alignment.sft import end_id
    from lmfs.fast.grpo import PipelineConfig, PipelinedGRPOTrainer

    cuda = next(model.parameters()).device.type == "cuda"
    config = grpo_config(sizes, autocast)
    trainer = PipelinedGRPOTrainer(model, tok, problems, config=config, pipeline=PipelineConfig(
        overlap_steps=overlap_steps, fused_model=fused_update, packed_update=packed_update,
        compile_update=compile_update))
    trainer.stop_ids = (end_id(tok),)                     # TRL stops at its eos token only: so do we here
    # The timer goes in before the warm-up, so that the CUDA graphs are captured with it in place.
    timer = ForwardTimer(trainer.llm)
    optimizer_timer = OptimizerTimer(trainer.optimizer, trainer.device)
    recorder = RolloutRecorder(trainer)
    n = sizes.steps
    try:
        trainer.train(2 if cuda else 1)                   # warm-up: CUDA graphs, allocator
        optimizer_timer.watch.events.clear()
        timer.reset()
        recorder.reset()
        # the timed steps in one call, so that each may start the next one's rollout (overlap_steps)
        start = time.perf_counter()
        with GcTimer() as collector:
            trainer.train(trainer.step + n)
        total = time.perf_counter() - start
        forwards = {kind: {key: value / n for key, value in part.items()} for kind, part in timer.breakdown().items()}
        useful = sum(part["useful_seconds"] for part in forwards.values()) * n
        optimizer_seconds = optimizer_timer.watch.seconds
    finally:
        timer.close()
        optimizer_timer.close()
        recorder.close()
    h = trainer.history
    phases = {p: sum(getattr(h, f"{p}_s")[-n:]) for p in PHASES}   # (a rollout's early start-up is the rollout's)
    rollout = recorder.stats
    micro_batches = -(-config.batch_size // config.micro_batch_size)
    # the tokens the last step's update ran: the sequences' own, and with the padding to each micro-batch's longest
    last = trainer.last_rollout
    tokens = [len(p) + len(r) for p, r in zip(last.prompt_ids, last.response_ids)]
    padded = sum(len(rows) * max(tokens[i] for i in rows) for rows, _, _ in trainer.micro_batches(last))
    result = dict(samples_per_s=config.batch_size * n / total, seconds_per_step=total / n,
                  useful_generation_share=useful / total,
                  useful_share_of_rollout=useful / phases["rollout"],
                  # per step and kind of forward: timed seconds, real and computed rows, useful seconds
                  forwards=forwards,
                  # "between": the step's time outside the trainer's timed phases (its records, the loop)
                  phase_share={**{p: s / total for p, s in phases.items()},
                               "between": max(total - sum(phases.values()), 0.0) / total},
                  # Python's garbage collections in the timed steps (in any phase): count per generation, s per step
                  garbage_collection={"collections": collector.collections, "seconds": collector.seconds / n},
                  response_length=sum(h.response_length[-n:]) / n,
                  # per step: where the rollout's time went, the rollout's wall time, the update's parts
                  rollout={**{k: v / n for k, v in rollout.items()}, "wall_seconds": phases["rollout"] / n,
                           "device_timed": cuda, "started_early": recorder.early / n,
                           "early_start_seconds": recorder.early_seconds / n},
                  update={"seconds": phases["update"] / n, "micro_batches": micro_batches,
                          "optimizer_seconds": optimizer_seconds / n,
                          "seconds_per_micro_batch": (phases["update"] - optimizer_seconds) / n / micro_batches,
                          "tokens": sum(tokens), "padded_tokens": padded},
                  # how the engine and the update ran (flags of lmfs.inference.LLM's stats; None where it
                  # does not report one)
                  engine={**{flag: trainer.rollout_stats.get(flag) for flag in ("cuda_graphs", "fused_decode")},
                          "autocast": (str(trainer.llm.autocast).removeprefix("torch.") if trainer.llm.autocast
                                       else None),
                          "fused_update": fused_update, "packed_update": packed_update,
                          "overlap_steps": overlap_steps, "compile_update": compile_update})
    if profile:
        result["profile"] = profile_step(trainer)
    return result


def grpo_config(sizes: Sizes, autocast: str = "auto"):
    """The benchmark's GRPO settings: one epoch, no KL penalty, temperature 1 (as TRL's run)."""
    from lmfs.alignment.grpo import GRPOConfig

    return GRPOConfig(group_size=sizes.group_size, prompts_per_step=sizes.prompts, max_new_tokens=sizes.max_new_tokens,
                      micro_batch_size=sizes.micro_batch, lr=1e-6, epochs_per_batch=1, kl_coef=0.0, temperature=1.0,
                      progress=False, autocast=autocast)


def run_sequential(model, tok, problems, sizes: Sizes, autocast: str = "auto") -> dict:
    """Samples per second of the sequential :class:`~lmfs.alignment.grpo.GRPOTrainer` (the algorithm as
    lecture 17 teaches it: plain modules, lmfs's AdamW, each phase waiting for the one before) on
    the same model, task and batch, timed as :func:`run_lmfs` times the pipelined trainer."""
    from lmfs.alignment.grpo import GRPOTrainer
    from lmfs.alignment.sft import end_id

    trainer = GRPOTrainer(model, tok, problems, config=grpo_config(sizes, autocast))
    trainer.stop_ids = (end_id(tok),)
    trainer.train(2 if next(model.parameters()).device.type == "cuda" else 1)      # warm-up
    start = time.perf_counter()
    trainer.train(trainer.step + sizes.steps)
    total = time.perf_counter() - start
    h = trainer.history
    return dict(samples_per_s=trainer.config.batch_size * sizes.steps / total, seconds_per_step=total / sizes.steps,
                response_length=sum(h.response_length[-sizes.steps:]) / sizes.steps,
                phase_share={p: sum(getattr(h, f"{p}_s")[-sizes.steps:]) / total for p in ("rollout", "reward",
                                                                                            "reference", "update")})


def profile_step(trainer) -> dict:
    """One more GRPO step under the profiler (:func:`lmfs.bench.timing.device_timeline`): for each
    part of the step, its host time and the GPU's busy time within it, and the longest stretches
    the GPU sat idle, with what the host was doing. The profiler slows the host, so the host's
    parts take longer than in the timed steps; where the GPU waits is what it shows."""
    from lmfs.bench.timing import device_timeline

    llm = trainer.llm
    parts = {"rollout": (trainer, "finish_rollout"), "scheduling": (llm.scheduler, "schedule"),
             "forwards": (llm.runner, "step"), "accepting": (llm.scheduler, "accept"), "reward": (trainer, "score"),
             "batch": (trainer, "micro_batches"), "update": (trainer, "update"),
             "optimizer": (trainer, "optimizer_step")}
    return device_timeline(lambda: trainer.train(trainer.step + 1), parts, gaps=10)


def run(sizes: Sizes | None = None, device=None, trl: bool = True, autocast: str = "auto",
        fused_update: bool = True, packed_update: bool = False, profile: bool = False,
        overlap_steps: bool = True, compile_update: bool = False, sequential: bool = True) -> dict:
    """Both measurements; prints the table; returns the numbers."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    sizes = sizes or (GPU_SIZES if cuda else CPU_SIZES)
    if not cuda:
        print("no CUDA GPU: a tiny model on the CPU, lmfs and TRL in this one run; the goals (useful generation "
              ">= 70% of a step, >= 2x TRL's samples/s) are for one H200")
    tok, model, problems = make_setup(sizes, device)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "sizes": asdict(sizes),
              "params": model.num_params(), "batch": sizes.prompts * sizes.group_size}
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    result["lmfs"] = run_lmfs(model, tok, problems, sizes, autocast, fused_update, packed_update, profile,
                              overlap_steps, compile_update)
    model.load_state_dict(initial)                       # TRL starts from the same weights
    gc.collect()
    if not trl:
        result["trl"] = {"error": "left out (--no-trl)"}
    else:
        try:
            from lmfs.benchmarks.grpo_trl import run_trl

            result["trl"] = run_trl(model, tok, problems, sizes, device)
        except Exception as err:  # TRL missing or refusing: lmfs's figures still stand
            result["trl"] = {"error": error_line(err)}
    if "error" not in result["trl"]:
        result["ratio"] = result["lmfs"]["samples_per_s"] / result["trl"]["samples_per_s"]
    if sequential:      # on a fresh copy of the same weights: the pipelined run fused its model in place
        _, plain, _ = make_setup(sizes, device)
        plain.load_state_dict(initial)
        gc.collect()
        result["sequential"] = run_sequential(plain, tok, problems, sizes, autocast)
        result["sequential_ratio"] = result["sequential"]["samples_per_s"] / result["lmfs"]["samples_per_s"]
    _print(result)
    return result


def _print(result: dict) -> None:
    import pandas as pd

    s, lm = result["sizes"], result["lmfs"]
    print(f"\nGRPO step on {result['device']}: {result['params'] / 1e6:.2f} M parameters (d_model {s['d_model']}, "
          f"{s['n_layers']} layers), {s['prompts']} prompts x {s['group_size']} answers = {result['batch']} sequences, "
          f"up to {s['max_new_tokens']} new tokens, micro-batch {s['micro_batch']}, {s['steps']} timed steps")
    rows = [{"trainer": "lmfs (pipelined)", "samples/s": f"{lm['samples_per_s']:.3g}",
             "s/step": f"{lm['seconds_per_step']:.3g}", "mean response tokens": f"{lm['response_length']:.1f}"}]
    if "sequential" in result:
        seq = result["sequential"]
        rows.append({"trainer": "lmfs (sequential)", "samples/s": f"{seq['samples_per_s']:.3g}",
                     "s/step": f"{seq['seconds_per_step']:.3g}", "mean response tokens": f"{seq['response_length']:.1f}"})
    trl = result["trl"]
    if "error" in trl:
        rows.append({"trainer": "TRL", "samples/s": "-", "s/step": "-", "mean response tokens": trl["error"]})
    else:
        length = trl["response_length"]
        rows.append({"trainer": "TRL", "samples/s": f"{trl['samples_per_s']:.3g}",
                     "s/step": f"{trl['seconds_per_step']:.3g}",
                     "mean response tokens": "-" if length is None else f"{length:.1f}"})
    print(pd.DataFrame(rows).to_string(index=False))
    print("lmfs step time by phase: " + ", ".join(f"{p} {v:.0%}" for p, v in lm["phase_share"].items()))
    g = lm["garbage_collection"]
    print(f"lmfs garbage collections in the timed steps: {g['seconds'] * 1e3:.1f} ms a step "
          f"(generations 0/1/2: {'/'.join(str(g['collections'][k]) for k in sorted(g['collections']))})")
    print("lmfs engine: " + ", ".join(f"{flag} {'-' if on is None else on}" for flag, on in lm["engine"].items()))
    print(f"useful generation: {lm['useful_generation_share']:.0%} of the step "
          f"({lm['useful_share_of_rollout']:.0%} of the rollout)")
    for kind, f in lm.get("forwards", {}).items():
        print(f"lmfs {kind} forwards per step: {f['seconds']:.4f} s timed, {f['rows']:,.0f} real of "
              f"{f['computed_rows']:,.0f} computed rows: {f['useful_seconds']:.4f} s useful")
    r, u = lm["rollout"], lm["update"]
    busy = r["decode_device_seconds"] / max(r["decode_seconds"], 1e-9)
    device = f"device {r['decode_device_seconds']:.3f} s = {busy:.0%} of" if r["device_timed"] else \
        "(no device time off CUDA)"
    print(f"lmfs rollout per step: {r['wall_seconds']:.3f} s wall; decode {device} {r['decode_seconds']:.3f} s wall "
          f"({r['decode_wait_seconds']:.3f} s of it waiting for tokens), {r['overlapped_steps']:.0f} of "
          f"{r['decode_steps']:.0f} decode steps launched while an earlier one ran; "
          f"prefill {r['prefill_seconds']:.3f} s; outside both (requests, admission, outputs, texts) "
          f"{r['wall_seconds'] - r['prefill_seconds'] - r['decode_seconds']:.3f} s")
    if r.get("started_early"):
        print(f"lmfs rollouts started during the update before: {r['started_early']:.0%} of the steps, "
              f"{r['early_start_seconds'] * 1e3:.1f} ms of host time a step (counted in the rollout above)")
    print(f"lmfs update per step: {u['seconds']:.3f} s = {u['micro_batches']} micro-batch(es) of up to "
          f"{s['micro_batch']} sequences x {u['seconds_per_micro_batch'] * 1e3:.1f} ms (forward + backward, "
          f"gradient clipping included) "
          f"+ optimizer step {u['optimizer_seconds'] * 1e3:.1f} ms")
    if "tokens" in u:
        computed = u["tokens"] if lm["engine"].get("packed_update") else u["padded_tokens"]
        how = "packed" if computed == u["tokens"] else "padded"
        print(f"lmfs update tokens (last step): {u['tokens']:,} in the sequences, {u['padded_tokens']:,} padded to "
              f"each micro-batch's longest; {computed:,} computed ({how})")
    if "profile" in lm:
        _print_profile(lm["profile"])
    if "sequential_ratio" in result:
        print(f"lmfs sequential / pipelined samples/s: {result['sequential_ratio']:.3g}x (sequential phases: "
              + ", ".join(f"{p} {v:.0%}" for p, v in result["sequential"]["phase_share"].items()) + ")")
    if "ratio" in result:
        print(f"lmfs / TRL samples/s: {result['ratio']:.3g}x")
    else:
        print("TRL is unavailable here: only lmfs's figures are reported")


def _print_profile(p: dict) -> None:
    import pandas as pd

    gpu = p["busy"] is not None
    print(f"\nlmfs, one more step under the profiler: {p['wall']:.1f} ms" +
          (f", the GPU busy {p['busy']:.1f} ms of it" if gpu else " (no GPU timeline off CUDA)"))
    rows = [{"part": name, "calls": v["calls"], "host ms": f"{v['wall']:.1f}",
             **({"GPU busy ms": f"{v['busy']:.1f}", "GPU idle ms": f"{v['wall'] - v['busy']:.1f}"} if gpu else {})}
            for name, v in p["parts"].items()]
    print(pd.DataFrame(rows).to_string(index=False))
    if p["gaps"]:
        print("the longest stretches with the GPU idle (ms from the step's start: length, the part the host "
              "was in, its operators there):")
        for g in p["gaps"]:
            ops = ", ".join(f"{name} {ms:.2f}" for name, ms in g["ops"].items()) or "no operator: Python"
            print(f"  at {g['at']:7.1f}: {g['ms']:5.2f} ms in {g['part']} ({ops})")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="GRPO step: useful generation share; lmfs vs TRL's GRPOTrainer "
                                                 "samples/s")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--tiny", action="store_true", help="the CPU sizes, also on a GPU")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up")
    parser.add_argument("--no-trl", action="store_true", help="leave out TRL's GRPOTrainer")
    parser.add_argument("--autocast", default="auto", choices=["auto", "bf16", "off"],
                        help="lmfs's update and rollouts: bf16 autocast on CUDA (auto), or float32 (off)")
    parser.add_argument("--no-fused-update", action="store_true",
                        help="train lmfs's policy through the plain modules, not lmfs.kernels.fused's")
    parser.add_argument("--packed-update", action="store_true",
                        help="lmfs's update on the sequences packed into one row, not right-padded")
    parser.add_argument("--no-overlap-steps", action="store_true",
                        help="start each rollout after the update before it has finished, not during it")
    parser.add_argument("--compile-update", action="store_true",
                        help="lmfs's update forward through torch.compile (PipelineConfig.compile_update)")
    parser.add_argument("--no-sequential", action="store_true",
                        help="leave out the sequential GRPOTrainer's run (its samples/s as a ratio of the pipelined one's)")
    parser.add_argument("--profile", action="store_true",
                        help="then one more lmfs step under the profiler: where the GPU waits, and for what")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = CPU_SIZES if args.tiny or device.type != "cuda" else GPU_SIZES
    if args.steps is not None:
        sizes = Sizes(**{**asdict(sizes), "steps": args.steps})
    result = run(sizes, device, trl=not args.no_trl, autocast=args.autocast, fused_update=not args.no_fused_update,
                 packed_update=args.packed_update, profile=args.profile, overlap_steps=not args.no_overlap_steps,
                 compile_update=args.compile_update, sequential=not args.no_sequential)
    save_json(result, args.json)
    return result

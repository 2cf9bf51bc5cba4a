"""Training throughput, MFU and peak memory of lmfs's transformer, against Hugging Face Llama.

    python -m lmfs.benchmarks train-step [--variants fused,plain,hf,hf+flex] [--json out.json] [--steps 30] [--profile]

On CUDA, for a GPT-2-small-sized Llama-style model (d_model 768, 12 layers, 12 heads, context
1024, vocabulary 32,000, SwiGLU, RoPE, RMSNorm, no biases, untied embeddings):

1. The device's measured peak: the median time of an 8192³ bf16 matmul after warm-up.
2. lmfs's ``TransformerLM``, ``torch.compile``d, one training step = forward and backward under
   bf16 autocast, then ``torch.optim.AdamW(fused=True)``; the same fixed batch every step, so
   data loading is not timed. Each step is timed with CUDA events after warm-up; we report the
   median. Achieved FLOP/s count ``6·N_mm + 3·attention`` FLOPs per token, attention over the
   full T×T scores (:mod:`lmfs.accounting`'s convention, as in PaLM's MFU), and MFU is given
   against both the measured and the datasheet peak.
3. The same weights as Hugging Face ``LlamaForCausalLM`` (via :func:`lmfs.nn.to_hf_llama`),
   compiled, same autocast and optimizer, with each of its attention implementations that can
   train fast here: ``"sdpa"`` and ``"flex_attention"``. The goal: the fast lmfs model (``fused``)
   at least 1.2× the tokens/s of the *fastest* of them (on an H200, FlexAttention: under
   ``torch.compile`` Hugging Face's SDPA path passes SDPA an explicit causal mask, which costs
   cuDNN its causal block skipping). Both sides use torch's fused AdamW, so the comparison is
   between the models alone. Each variant is built, compiled, timed and freed before the next,
   so each peak memory is its own.
4. Peak memory of one step (``torch.cuda.max_memory_allocated``) against
   :func:`lmfs.bench.memory.training_memory`, whose formula counts the tensors eager PyTorch
   keeps: checked eagerly, before anything is compiled, for the plain model and for the fused
   one with the loss from the logits. Compiled code fuses operations and keeps fewer, so the
   compiled fast model's ratio is expected below 1.

**Variants** (``--variants``, comma-separated; the default is ``fused,plain,hf,hf+flex``,
``ablation`` is :data:`ABLATION`). Every variant trains the same weights on the same batch with
the same optimizer, autocast and compile mode (``--compile-mode``, the same for every compiled
variant; default ``"default"``); they differ in the model's own code paths only:

* ``plain``: ``TransformerLM`` as ``lmfs.nn`` builds it, the model the lectures teach: one matmul
  per projection, the loss from the logits with ``F.cross_entropy``.
* ``fused``: the same model through :func:`lmfs.kernels.fused.fuse_model`: q/k/v and gate/up as
  one matmul each, on a GPU the Triton kernels of :mod:`lmfs.kernels.fused` for RoPE, SwiGLU and
  the loss, and the loss computed chunk by chunk without keeping the logits
  (:func:`lmfs.kernels.linear_cross_entropy`).
* ``hf``: Hugging Face's Llama (``attn_implementation="sdpa"``), compiled; ``hf+flex``: with
  ``"flex_attention"`` instead; ``hf-eager``: not compiled, for context.
* Modifiers, appended: ``+proj`` / ``-proj`` (fused projections), ``+kern`` / ``-kern`` (the
  Triton kernels), ``+loss`` / ``-loss`` (chunked loss), for ``fused`` and ``plain``;
  ``+cudnn`` / ``+flash`` / ``+efficient`` / ``+math`` (the SDPA kernel to try first, also for
  ``hf``; by default each side gets SDPA's own choice, see
  :func:`lmfs.kernels.fused.prefer_sdpa_backend`), ``-eager`` (not compiled). E.g. ``fused-proj``
  or ``plain+loss``. Measured on an H200 in one run (README): fused projections with the kernels
  28.2 ms a step, separate projections 30.0, fused projections without the kernels 32.0
  (Inductor's backward of the split is slow); the fast model is at 27.5–27.7 ms since a later
  RoPE change.

The table gives each variant's tokens/s relative to ``hf`` and to ``plain`` when those ran.
``--profile`` adds each variant's kernel table and a summary of GPU time per step by kind of
kernel (matmul, attention, optimizer, other; :func:`lmfs.bench.timing.kernel_kind`), with the
gaps in between, and the most any model could gain over ``hf`` while running the same matmuls
and attention (see :func:`report_kernel_kinds`). That table found the cost the RoPE tables had
when computed inside the compiled step (:class:`lmfs.nn.RotaryEmbedding`).
Every compiled variant costs a compilation (about 40 s for this model on an H200); dynamo is
reset before each, so none reuses or recompiles another's graphs.

Without a GPU (or with ``--device cpu``) it runs a tiny model (d_model 64) for a few steps on the
CPU, uncompiled, so the code path is exercised; those numbers say nothing about real hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import re
import time

import torch

from lmfs.accounting import attention_flops_per_token, matmul_params, training_flops
from lmfs.bench import save_json
from lmfs.bench.memory import peak_memory, training_memory
from lmfs.bench.probes import matmul_rate
from lmfs.bench.timing import benchmark, profile_table
from lmfs.env import resolve_device
from lmfs.hardware import for_device
from lmfs.kernels.fused import SDPA_BACKENDS, fuse_model, sdpa_preference
from lmfs.nn import TransformerConfig, TransformerLM, to_hf_llama
from lmfs.train.loop import accumulate_gradients

DEFAULT_VARIANTS = "fused,plain,hf,hf+flex"
ABLATION = "plain,fused,fused-proj,fused-kern,fused-loss,fused-proj-kern,fused+flash,hf,hf+flex,hf-eager"


def gpt2_small(vocab_size: int = 32000, context_length: int = 1024) -> TransformerConfig:
    """GPT-2 small's width and depth in lmfs's Llama-style defaults: 134M parameters untied."""
    return TransformerConfig(vocab_size=vocab_size, context_length=context_length, d_model=768,
                             n_layers=12, n_heads=12, tie_embeddings=False)


def tiny() -> TransformerConfig:
    """A model small enough for a CPU test to train in milliseconds."""
    return TransformerConfig(vocab_size=512, context_length=64, d_model=64, n_layers=2, n_heads=4,
                             tie_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the comparison: which model, and which of its code paths."""

    name: str
    model: str = "lmfs"                # "lmfs" or "hf"
    projections: bool = True           # lmfs: fuse_model(projections=...)
    triton: bool = True                # lmfs: fuse_model(triton=...), the kernels of lmfs.kernels.fused
    chunked_loss: bool = True          # lmfs: fuse_model(chunked_loss=...), no logits kept
    sdpa_backend: str = "auto"         # SDPA kernel tried first (CUDA); "auto": SDPA's own order
    hf_attention: str = "sdpa"         # hf: its attn_implementation, "sdpa" or "flex_attention"
    compiled: bool = True              # torch.compile (on CUDA; never on the CPU)

    def describe(self) -> str:
        if self.model == "hf":
            parts = ["Hugging Face LlamaForCausalLM", f"attn_implementation={self.hf_attention!r}"]
        elif not (self.projections or self.triton or self.chunked_loss):
            parts = ["lmfs TransformerLM as built (separate projections, logits + F.cross_entropy)"]
        else:
            parts = ["lmfs through fuse_model", "fused q/k/v, gate/up" if self.projections else "separate projections",
                     "Triton kernels" if self.triton else "no Triton kernels",
                     "chunked loss, no logits" if self.chunked_loss else "logits + F.cross_entropy"]
        first = "its own choice" if self.sdpa_backend == "auto" else f"{self.sdpa_backend} first"
        parts.append(f"SDPA: {first}")
        parts.append("compiled" if self.compiled else "eager")
        return ", ".join(parts)


def parse_variant(name: str) -> Variant:
    """``fused``, ``plain`` or ``hf``, then modifiers such as ``-proj``, ``+loss``, ``+cudnn``,
    ``-eager`` (see the module docstring)."""
    match = re.fullmatch(r"(fused|plain|hf)((?:[+-][a-z]+)*)", name.strip())
    if not match:
        raise ValueError(f"unknown variant {name!r}: use fused, plain or hf, optionally followed by "
                         "+proj/-proj, +kern/-kern, +loss/-loss, +cudnn/+flash/+efficient/+math, -eager")
    base, modifiers = match.groups()
    fast = base == "fused"  # fuse_model's three switches: all on for fused, all off for plain and HF
    fields = dict(model="hf" if base == "hf" else "lmfs", projections=fast, triton=fast, chunked_loss=fast)
    for sign, word in re.findall(r"([+-])([a-z]+)", modifiers):
        if word == "eager" and sign == "-":
            fields["compiled"] = False
        elif word in SDPA_BACKENDS and sign == "+":
            fields["sdpa_backend"] = word
        elif word == "flex" and base == "hf" and sign == "+":
            fields["hf_attention"] = "flex_attention"
        elif word in ("proj", "kern", "loss") and base != "hf":
            key = {"proj": "projections", "kern": "triton", "loss": "chunked_loss"}[word]
            fields[key] = sign == "+"
        else:
            raise ValueError(f"variant {name!r}: modifier {sign}{word} does not apply; fused and plain take "
                             "+proj/-proj, +kern/-kern, +loss/-loss; hf takes +flex (FlexAttention); every "
                             "variant takes +cudnn/+flash/+efficient/+math and -eager")
    return Variant(name=name.strip(), **fields)


def parse_variants(spec: str) -> list[Variant]:
    """A comma-separated list of variant names (``ablation`` expands to :data:`ABLATION`)."""
    names = [n for n in spec.replace("ablation", ABLATION).split(",") if n.strip()]
    variants = [parse_variant(n) for n in names]
    if len({v.name for v in variants}) != len(variants):
        raise ValueError(f"variants repeat a name: {spec!r}")
    return variants


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """torch's AdamW (fused on CUDA) with lmfs's decay groups: matrices decayed, vectors not."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda")


def training_step(forward, optimizer, x, y, dtype):
    """One step: forward and backward (``forward(x, y)`` returns the loss), optimizer step, zero.
    Returns the loss (a tensor: reading it would make the host wait for the GPU)."""
    loss = accumulate_gradients(forward, [(x, y)], dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def hf_llama(model: TransformerLM, device: torch.device, attention: str = "sdpa"):
    """Hugging Face ``LlamaForCausalLM`` with ``model``'s weights, no KV cache, and ``attention`` as
    its ``attn_implementation`` (``"sdpa"``, ``"flex_attention"``, ``"eager"``)."""
    from transformers import LlamaForCausalLM

    state, hf_config = to_hf_llama(model)
    hf_config.use_cache = False  # training builds no cache
    hf = LlamaForCausalLM._from_config(hf_config, attn_implementation=attention)
    hf.load_state_dict(state)
    return hf.to(device).train()


class HFLoss(torch.nn.Module):
    """Wraps a Hugging Face causal LM as ``(x, y) -> (None, loss)``, lmfs's calling convention.

    Hugging Face shifts the labels itself, so ``labels=x``: ``T - 1`` predictions per sequence
    instead of our ``T``, a 0.1 % difference at T = 1024.
    """

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, x, y):
        return None, self.hf(input_ids=x, labels=x).loss


class PreferSDPA(torch.nn.Module):
    """``module(x, y)`` with SDPA trying ``backend`` first (on CUDA; ``"auto"``: SDPA's own choice).

    The context is entered inside ``forward``, so that ``torch.compile`` traces it and bakes the
    chosen kernel, forward and backward, into the graph."""

    def __init__(self, module: torch.nn.Module, backend: str = "auto"):
        super().__init__()
        self.module, self.backend = module, backend

    def forward(self, x, y):
        with sdpa_preference(self.backend, x.device):
            return self.module(x, y)


def sdpa_default(config: TransformerConfig, batch: int, device: torch.device) -> str:
    """The kernel SDPA picks by itself for this model's causal attention in bf16 (CUDA)."""
    try:
        q = torch.zeros(batch, config.n_heads, config.context_length, config.head_dim, device=device,
                        dtype=torch.bfloat16, requires_grad=True)
        return torch.nn.attention.SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name
    except Exception as err:  # a private function: report, do not fail the benchmark
        return f"unknown ({type(err).__name__})"


def free_memory(device: torch.device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def graph_count() -> int:
    """Graphs dynamo has compiled since the last reset (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def run(steps: int, batch_size: int | None, hf: bool = True, device: str = "auto",
        variants: str = DEFAULT_VARIANTS, profile: bool = False, compile_mode: str = "default") -> dict:
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    device = resolve_device(device)
    cuda = device.type == "cuda"
    chosen = [dataclasses.replace(v, compiled=v.compiled and cuda)  # never compiled on the CPU
              for v in parse_variants(variants) if hf or v.model != "hf"]
    if not cuda:  # FlexAttention has no backward on the CPU
        skipped = [v.name for v in chosen if v.hf_attention == "flex_attention"]
        if skipped:
            print(f"{', '.join(skipped)} skipped: FlexAttention trains only on a GPU")
        chosen = [v for v in chosen if v.name not in skipped]
    config = gpt2_small() if cuda else tiny()
    B, T = (batch_size or (16 if cuda else 4)), config.context_length
    dtype = torch.bfloat16 if cuda else None
    warmup = 5 if cuda else 1  # after the first step, which compiles and is timed on its own
    if not cuda:
        print(f"on {device}: a tiny model, to exercise the code; real numbers need a CUDA GPU")
        steps = min(steps, 5)

    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": dict(d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads,
                            context=T, vocab=config.vocab_size, batch=B),
              "optimizer": "torch.optim.AdamW(fused=True)" if cuda else "torch.optim.AdamW",
              "autocast": "bf16" if cuda else "off", "compiled": cuda, "compile_mode": compile_mode,
              "steps_timed": steps, "warmup_steps": warmup, "variants": [v.name for v in chosen]}
    flops_per_token = training_flops(config, 1, T)
    result["train_flops_per_token"] = flops_per_token
    print(f"model: d_model {config.d_model}, {config.n_layers} layers, {config.n_heads} heads, context {T}, "
          f"vocab {config.vocab_size}; batch {B} x {T} = {B * T:,} tokens/step")
    print(f"training FLOPs/token = 6·N_mm ({6 * matmul_params(config) / 1e9:.3f} G) + 3·attention "
          f"({3 * attention_flops_per_token(config, T) / 1e9:.3f} G, full T×T) "
          f"= {flops_per_token / 1e9:.3f} G")

    # The measured ceiling: an 8192³ bf16 matmul on a GPU (512³ fp32 on a CPU), median of 20.
    measured = matmul_rate(8192 if cuda else 512, "bf16" if cuda else "fp32", device=device)
    chip = for_device(device)  # None on a CPU or a GPU lmfs.hardware does not list
    sheet = chip.peak("bf16") if chip else None
    result.update(measured_peak_flops=measured, datasheet_peak_flops=sheet)
    print(f"measured matmul peak: {measured / 1e12:.1f} TFLOP/s"
          + (f" (datasheet bf16 dense: {sheet / 1e12:.1f})" if sheet else ""))
    if cuda:
        result["cudnn_version"] = torch.backends.cudnn.version()
        result["sdpa_default_backend"] = sdpa_default(config, B, device)
        print(f"SDPA's own choice for this attention (bf16, causal, head_dim {config.head_dim}): "
              f"{result['sdpa_default_backend']}; cuDNN {result['cudnn_version']}")

    # One set of weights for every variant (the switches change code paths, not parameters).
    torch.manual_seed(0)
    reference = TransformerLM(config)
    state = reference.state_dict()
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(config.vocab_size, (B, T), generator=generator).to(device)
    y = torch.randint(config.vocab_size, (B, T), generator=generator).to(device)

    def lmfs_model(projections=False, triton=False, chunked_loss=False) -> TransformerLM:
        """The reference weights in a new model, through fuse_model when any switch is on."""
        model = TransformerLM(config)
        model.load_state_dict(state)
        return fuse_model(model.to(device), projections=projections, triton=triton, chunked_loss=chunked_loss)

    if cuda:  # eager, loss from the logits, plain and fused: the tensors training_memory's formula counts
        for name, fused in [("", False), ("_fused", True)]:
            model = lmfs_model(projections=fused, triton=fused)
            optimizer = adamw(model, device)
            eager = peak_memory(lambda: training_step(model, optimizer, x, y, dtype), device)  # noqa: B023
            predicted = training_memory(config, B, T, compute_bytes=2, fused_projections=fused,
                                        triton_kernels=fused)["total"]
            result[f"memory_ratio_eager{name}"] = eager / predicted
            result[f"predicted_memory{name}"] = predicted
            del model, optimizer
            free_memory(device)
        result["predicted_memory_fast"] = training_memory(config, B, T, compute_bytes=2, fused_projections=True,
                                                          triton_kernels=True, chunked_loss=True)["total"]
    else:
        result["predicted_memory"] = training_memory(config, B, T, compute_bytes=4)["total"]

    def measure(variant: Variant) -> dict:
        if variant.model == "hf":
            params = HFLoss(hf_llama(reference, device, variant.hf_attention))
        else:
            params = lmfs_model(variant.projections, variant.triton, variant.chunked_loss)
        module = PreferSDPA(params, variant.sdpa_backend)
        torch._dynamo.reset()  # no graphs, guards or recompile budget carried over from another variant
        forward = torch.compile(module, mode=compile_mode) if variant.compiled else module
        optimizer = adamw(params, device)
        step = lambda: training_step(forward, optimizer, x, y, dtype)  # noqa: E731
        start = time.perf_counter()
        first_loss = step().item()  # compiles forward and backward; creates the optimizer state
        first_step_s = time.perf_counter() - start
        graphs = graph_count()
        seconds = benchmark(step, warmup=warmup, repeats=steps, device=device).median
        recompiled = graph_count() != graphs
        if recompiled:
            print(f"warning: {variant.name} compiled again after its first step: its timing may include it")
        achieved = flops_per_token * B * T / seconds
        out = dict(step_ms=seconds * 1e3, tokens_per_s=B * T / seconds, achieved_flops=achieved,
                   mfu_measured=achieved / measured, mfu_datasheet=achieved / sheet if sheet else None,
                   peak_memory=peak_memory(step, device), first_step_s=first_step_s, first_loss=first_loss,
                   recompiled=recompiled, **dataclasses.asdict(variant))
        if profile:
            table = profile_table(step, warmup=1, repeats=3, row_limit=40)
            print(f"\n{variant.name}: {variant.describe()}; {table.attrs['where']} per step")
            print(table.to_string(index=False, formatters={"name": lambda n: n[:100], "total_us": "{:,.0f}".format,
                                                           "mean_us": "{:,.1f}".format,
                                                           "share": "{:.1%}".format}))
            out["profile"] = table.to_dict(orient="records")
            out["kernel_ms"] = {kind: us / 1e3 for kind, us in table.attrs["kinds_us"].items()}
        return out

    for variant in chosen:
        if variant.model == "hf" and importlib.util.find_spec("transformers") is None:
            print(f"{variant.name} skipped: transformers is not installed")
            continue
        print(f"{variant.name}: {variant.describe()} ...", flush=True)
        try:
            result[variant.name] = measure(variant)
        except Exception as err:  # one variant failing (e.g. a compile error) should not lose the others
            print(f"{variant.name} FAILED: {type(err).__name__}: {err}", flush=True)
            result.setdefault("failed", {})[variant.name] = f"{type(err).__name__}: {err}"
        torch._dynamo.reset()  # drop the compiled code, whose caches may still refer to the model
        free_memory(device)  # the model and optimizer went with measure's frame

    timed = [v.name for v in chosen if v.name in result]
    for reference_name, key in [("hf", "vs_hf"), ("plain", "vs_plain")]:
        if reference_name in result:
            for name in timed:
                result[name][key] = result[name]["tokens_per_s"] / result[reference_name]["tokens_per_s"]
    # The goal's peer is Hugging Face with its best attention implementation: the fastest of the
    # Hugging Face variants that ran under the same compile setting as the lmfs model compared.
    for name in ("fused", "plain"):
        if name not in result:
            continue
        peers = [n for n in timed if result[n]["model"] == "hf" and result[n]["compiled"] == result[name]["compiled"]]
        if peers:
            best = max(peers, key=lambda n: result[n]["tokens_per_s"])
            result["best_hf"] = best
            result[f"{name}_vs_best_hf"] = result[name]["tokens_per_s"] / result[best]["tokens_per_s"]
    for name in timed:  # --profile: the most a variant could gain over hf with the same library kernels
        if cuda and "kernel_ms" in result[name] and "hf" in result:
            library = result[name]["kernel_ms"]["matmul"] + result[name]["kernel_ms"]["attention"]
            result[name]["ceiling_vs_hf"] = result["hf"]["step_ms"] / library if library > 0 else None
    if cuda and "fused" in result:
        result["memory_ratio_compiled"] = result["fused"]["peak_memory"] / result["predicted_memory_fast"]
    report(result)
    if profile and cuda:
        report_kernel_kinds(result)
    return result


def report_kernel_kinds(r: dict) -> None:
    """Where each variant's step goes by kind of kernel (``--profile``), and what that bounds.

    Matmuls (cuBLAS) and attention (cuDNN or our kernels) are library kernels that every model of
    this shape runs the same FLOPs through; the rest (norms, activations, RoPE, the loss, the
    optimizer, gaps between kernels) is what a model's own code can shrink. So a variant cannot be
    faster than ``hf`` by more than ``hf step / (its matmul + attention time)``: that is the
    ceiling printed, the speed-up if everything else took no time at all."""
    names = [n for n in r["variants"] if n in r and "kernel_ms" in r[n]]
    if not names:
        return
    kinds = list(r[names[0]]["kernel_ms"])
    width = max(len(n) for n in names) + 2
    print("\nGPU time per step by kind of kernel, ms (profiler; 'gaps' = step time - kernel time)")
    print(f"{'variant':<{width}}" + "".join(f"{k:>11}" for k in kinds + ["gaps", "step"]) + "   ceiling x hf")
    for name in names:
        row = r[name]
        ms = row["kernel_ms"]
        gaps = row["step_ms"] - sum(ms.values())
        ceiling = row.get("ceiling_vs_hf")
        print(f"{name:<{width}}" + "".join(f"{ms[k]:>11.2f}" for k in kinds)
              + f"{gaps:>11.2f}{row['step_ms']:>11.2f}" + (f"{ceiling:>15.3f}" if ceiling else ""))


def report(r: dict) -> None:
    """Print the results of :func:`run` as a table, one row per variant."""
    gib = 2**30
    names = [name for name in r["variants"] if name in r]
    columns = [("step ms", "step_ms", "{:.1f}", 1), ("tokens/s", "tokens_per_s", "{:,.0f}", 1),
               ("TFLOP/s", "achieved_flops", "{:.1f}", 1e12), ("MFU meas", "mfu_measured", "{:.1%}", 1),
               ("MFU sheet", "mfu_datasheet", "{:.1%}", 1), ("peak GiB", "peak_memory", "{:.2f}", gib),
               ("x hf", "vs_hf", "{:.3f}", 1), ("x plain", "vs_plain", "{:.3f}", 1),
               ("1st step s", "first_step_s", "{:.1f}", 1), ("1st loss", "first_loss", "{:.4f}", 1)]
    width = max([len(n) for n in names] + [8]) + 2
    print(f"\n{'variant':<{width}}" + "".join(f"{label:>12}" for label, *_ in columns))
    for name in names:
        row = r[name]
        cells = [row.get(key) for _, key, _, _ in columns]
        print(f"{name:<{width}}" + "".join(f"{'-' if v is None else fmt.format(v / unit):>12}"
                                           for v, (_, _, fmt, unit) in zip(cells, columns)))
    print("\n" + "\n".join(f"  {name:<{width}}{Variant(**{k: r[name][k] for k in _FIELDS}).describe()}"
                           for name in names))
    for name, label in [("fused", "the fast model (fused)"), ("plain", "the plain model (plain)")]:
        if f"{name}_vs_best_hf" in r:
            print(f"tokens/s of {label} / the fastest Hugging Face variant ({r['best_hf']}): "
                  f"{r[f'{name}_vs_best_hf']:.3f}x" + (" (goal >= 1.2)" if name == "fused" else ""))
    if "memory_ratio_eager" in r:
        print(f"predicted peak memory (training_memory, eager, loss from logits): plain "
              f"{r['predicted_memory'] / gib:.2f} GiB, fused {r['predicted_memory_fused'] / gib:.2f} GiB")
        print(f"measured / predicted peak memory: eager plain {r['memory_ratio_eager']:.3f}, eager fused "
              f"{r['memory_ratio_eager_fused']:.3f}"
              + (f", compiled fast model {r['memory_ratio_compiled']:.3f}" if "memory_ratio_compiled" in r else ""))
    else:
        print(f"predicted peak memory (training_memory, plain model, fp32): {r['predicted_memory'] / gib:.3f} GiB")


_FIELDS = [f.name for f in dataclasses.fields(Variant)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmfs.benchmarks train-step", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after warm-up)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 16 on GPU)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated (default {DEFAULT_VARIANTS}); 'ablation' = {ABLATION}")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face variants")
    parser.add_argument("--profile", action="store_true", help="also print each variant's top kernels")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                        help="torch.compile's mode for every compiled variant (reduce-overhead: CUDA graphs)")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: a tiny model)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.steps, args.batch_size, hf=not args.no_hf, device=args.device, variants=args.variants,
                 profile=args.profile, compile_mode=args.compile_mode)
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()

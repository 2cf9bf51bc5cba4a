"""Training throughput, MFU and peak memory of lmfs's transformer, against Hugging Face Llama.

    python -m lmfs.bench.train [--json out.json] [--steps 30] [--batch-size 16]

On CUDA, for a GPT-2-small-sized Llama-style model (d_model 768, 12 layers, 12 heads, context
1024, vocabulary 32,000, SwiGLU, RoPE, RMSNorm, no biases, untied embeddings):

1. The device's measured peak: the median time of an 8192³ bf16 matmul after warm-up.
2. Our ``TransformerLM``, ``torch.compile``d, one training step = forward and backward under
   bf16 autocast, then ``torch.optim.AdamW(fused=True)``; the same fixed batch every step, so
   data loading is not timed. Each step is timed with CUDA events after warm-up; we report the
   median. Achieved FLOP/s count ``6·N_mm + 3·attention`` FLOPs per token, attention over the
   full T×T scores (:mod:`lmfs.accounting`'s convention, as in PaLM's MFU), and MFU is given
   against both the measured and the datasheet peak.
3. The same weights as Hugging Face ``LlamaForCausalLM`` (via :func:`lmfs.nn.to_hf_llama`),
   ``attn_implementation="sdpa"``, compiled, same autocast and optimizer: the tokens/s ratio.
   Both use torch's fused AdamW, so the comparison is between the models alone. Ours is freed
   first, so each peak memory is that model's alone.
4. Peak memory of one step (``torch.cuda.max_memory_allocated``) against
   :func:`lmfs.accounting.training_memory`, whose formula counts the tensors eager PyTorch keeps;
   compiled code fuses operations and keeps fewer, so its ratio is expected below 1.

Without a GPU (or with ``--device cpu``) it runs a tiny model (d_model 64) for a few steps on the
CPU so the code path is exercised; those numbers say nothing about real hardware.
"""

from __future__ import annotations

import argparse

import torch

from lmfs.accounting import (PEAK_FLOPS, attention_flops_per_token, matmul_params, training_flops,
                             training_memory)
from lmfs.bench import save_json
from lmfs.bench.probes import matmul_rate
from lmfs.bench.roofline import datasheet
from lmfs.bench.timing import benchmark
from lmfs.env import resolve_device
from lmfs.nn import TransformerConfig, TransformerLM, to_hf_llama
from lmfs.train.loop import accumulate_gradients


def gpt2_small(vocab_size: int = 32000, context_length: int = 1024) -> TransformerConfig:
    """GPT-2 small's width and depth in lmfs's Llama-style defaults: 134M parameters untied."""
    return TransformerConfig(vocab_size=vocab_size, context_length=context_length, d_model=768,
                             n_layers=12, n_heads=12, tie_embeddings=False)


def tiny() -> TransformerConfig:
    """A model small enough for a CPU test to train in milliseconds."""
    return TransformerConfig(vocab_size=512, context_length=64, d_model=64, n_layers=2, n_heads=4,
                             tie_embeddings=False)


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """torch's AdamW (fused on CUDA) with lmfs's decay groups: matrices decayed, vectors not."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda")


def training_step(forward, optimizer, x, y, dtype):
    """One step: forward and backward (``forward(x, y)`` returns the loss), optimizer step, zero."""
    accumulate_gradients(forward, [(x, y)], dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hf_llama(model: TransformerLM, device: torch.device):
    """Hugging Face ``LlamaForCausalLM`` with ``model``'s weights, SDPA attention and no KV cache."""
    from transformers import LlamaForCausalLM

    state, hf_config = to_hf_llama(model)
    hf_config.use_cache = False  # training builds no cache
    hf = LlamaForCausalLM._from_config(hf_config, attn_implementation="sdpa")
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


def peak_memory(step, device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` over one call of ``step`` (after one untimed call)."""
    if device.type != "cuda":
        return None
    step()  # the optimizer state exists from the first step on; measure a later one
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def run(steps: int, batch_size: int | None, hf: bool = True, device: str = "auto") -> dict:
    device = resolve_device(device)
    cuda = device.type == "cuda"
    config = gpt2_small() if cuda else tiny()
    B, T = (batch_size or (16 if cuda else 4)), config.context_length
    dtype = torch.bfloat16 if cuda else None
    warmup = 5 if cuda else 1
    if not cuda:
        print(f"on {device}: a tiny model, to exercise the code; real numbers need a CUDA GPU")
        steps = min(steps, 5)

    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": dict(d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads,
                            context=T, vocab=config.vocab_size, batch=B),
              "optimizer": "torch.optim.AdamW(fused=True)" if cuda else "torch.optim.AdamW",
              "autocast": "bf16" if cuda else "off", "compiled": cuda, "steps_timed": steps}
    flops_per_token = training_flops(config, 1, T)
    result["train_flops_per_token"] = flops_per_token
    print(f"model: d_model {config.d_model}, {config.n_layers} layers, {config.n_heads} heads, context {T}, "
          f"vocab {config.vocab_size}; batch {B} x {T} = {B * T:,} tokens/step")
    print(f"training FLOPs/token = 6·N_mm ({6 * matmul_params(config) / 1e9:.3f} G) + 3·attention "
          f"({3 * attention_flops_per_token(config, T) / 1e9:.3f} G, full T×T) "
          f"= {flops_per_token / 1e9:.3f} G")

    # The measured ceiling: an 8192³ bf16 matmul on a GPU (512³ fp32 on a CPU), median of 20.
    measured = matmul_rate(8192 if cuda else 512, "bf16" if cuda else "fp32", device=device)
    chip = datasheet(PEAK_FLOPS, torch.cuda.get_device_name(device)) if cuda else None
    sheet = chip["bf16"] if chip else None
    result.update(measured_peak_flops=measured, datasheet_peak_flops=sheet)
    print(f"measured matmul peak: {measured / 1e12:.1f} TFLOP/s"
          + (f" (datasheet bf16 dense: {sheet / 1e12:.1f})" if sheet else ""))

    torch.manual_seed(0)
    ours = TransformerLM(config).to(device)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(config.vocab_size, (B, T), generator=generator).to(device)
    y = torch.randint(config.vocab_size, (B, T), generator=generator).to(device)

    def measure(model) -> dict:
        optimizer = adamw(model, device)
        forward = torch.compile(model) if cuda else model
        step = lambda: training_step(forward, optimizer, x, y, dtype)  # noqa: E731
        seconds = benchmark(step, warmup=warmup, repeats=steps, device=device).median
        achieved = flops_per_token * B * T / seconds
        return dict(step_ms=seconds * 1e3, tokens_per_s=B * T / seconds, achieved_flops=achieved,
                    mfu_measured=achieved / measured, mfu_datasheet=achieved / sheet if sheet else None,
                    peak_memory=peak_memory(step, device))

    result["lmfs"] = measure(ours)
    predicted = training_memory(config, B, T, compute_bytes=2 if cuda else 4)["total"]
    result["predicted_memory"] = predicted
    if cuda:  # the same step, eager: the memory formula counts the tensors eager PyTorch keeps
        optimizer = adamw(ours, device)
        eager = peak_memory(lambda: training_step(ours, optimizer, x, y, dtype), device)
        result["memory_ratio_eager"] = eager / predicted
        result["memory_ratio_compiled"] = result["lmfs"]["peak_memory"] / predicted
        del optimizer
    if hf:
        try:
            hf_model = HFLoss(hf_llama(ours, device))
        except ImportError as err:
            print(f"Hugging Face comparison skipped: {err}")
        else:
            del ours  # measure Hugging Face's memory without ours beside it
            if cuda:
                torch.cuda.empty_cache()
            result["hf"] = measure(hf_model)
            result["speedup_vs_hf"] = result["lmfs"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    report(result)
    return result


def report(r: dict) -> None:
    """Print the results of :func:`run` as a table."""
    gib = 2**30
    names = [name for name in ("lmfs", "hf") if name in r]
    print(f"\n{'':24}" + "".join(f"{name:>14}" for name in names))
    rows = [("step (ms)", "step_ms", "{:.1f}", 1), ("tokens/s", "tokens_per_s", "{:,.0f}", 1),
            ("TFLOP/s", "achieved_flops", "{:.1f}", 1e12), ("MFU vs measured", "mfu_measured", "{:.1%}", 1),
            ("MFU vs datasheet", "mfu_datasheet", "{:.1%}", 1),
            ("peak memory (GiB)", "peak_memory", "{:.2f}", gib)]
    for label, key, fmt, unit in rows:
        values = [r[name][key] for name in names]
        print(f"{label:24}" + "".join(f"{'-' if v is None else fmt.format(v / unit):>14}" for v in values))
    if "speedup_vs_hf" in r:
        print(f"\ntokens/s lmfs / Hugging Face: {r['speedup_vs_hf']:.2f}x (goal >= 1.2)")
    print(f"predicted peak memory (training_memory, eager): {r['predicted_memory'] / gib:.2f} GiB")
    if "memory_ratio_eager" in r:
        print(f"measured / predicted peak memory: eager {r['memory_ratio_eager']:.3f}, "
              f"compiled {r['memory_ratio_compiled']:.3f}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmfs.bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after warm-up)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 16 on GPU)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: a tiny model)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.steps, args.batch_size, hf=not args.no_hf, device=args.device)
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()

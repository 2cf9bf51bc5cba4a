"""Mixture-of-experts dispatch: forward+backward tokens/s of one MoE layer, six ways.

    python -m lmfs.benchmarks moe [--tokens 16384] [--device cuda] [--json out.json] [--profile]

The layer (on CUDA, bf16; DeepSeek-MoE-like) is :class:`lmfs.nn.moe.MoE` with d_model 1024, 64
routed SwiGLU experts of width 512, top-8 (softmax, then top-k, no renormalisation), one shared
SwiGLU expert of width 512, no capacity limit, 16,384 tokens. Each implementation runs the
forward and the backward (gradients for the input and every weight) on the same weights and tokens:

a. **loop**: ``dispatch="loop"``: one expert at a time: find its tokens, run it, add the weighted
   result back. Each expert costs a host round trip (finding the tokens) and three small matmuls.
b. **lmfs triton**: ``dispatch="sorted"`` (sort the assignments by expert, run all experts as
   grouped matmuls, combine) with the grouped matmuls done by :func:`lmfs.kernels.grouped_matmul`.
c. **torch grouped_mm**: the same with PyTorch's own grouped matmul, where the installed torch
   has one.
d. **lmfs fused**: :func:`lmfs.kernels.moe.use_fused_moe`: the sorted dispatch fused into Triton
   kernels: the gather of the tokens inside the first grouped matmul, SwiGLU and the routing
   weights in the matmuls' epilogues, the sum per token in a combine by the inverse permutation
   (no atomic adds), forward and backward.
e. **HF Qwen2-MoE**: Hugging Face ``transformers``' ``Qwen2MoeSparseMoeBlock`` built from a config
   (no download) holding the same weights, timed with each of its expert implementations that
   runs here (``eager``, ``grouped_mm``, ``batched_mm``); the fastest counts. Its shared expert
   sits behind a sigmoid gate; a zero gate weight (sigmoid = ½) and a doubled shared down
   projection make it compute exactly our layer.
f. **dense SwiGLU** with the same active width (k × 512 + 512 = 4608): the same matmul FLOPs per
   token without routing, the ceiling for b, c and d.

FLOPs counted (for TFLOP/s): the active matmuls, ``6 · d_model · active width`` per token
forward plus the router's ``2 · d_model · E``, three times that for forward + backward; the same
count for every MoE implementation. Ratios printed: each fast dispatch ÷ the loop (tokens/s), lmfs
÷ HF (tokens/s), and each MoE's TFLOP/s ÷ the dense layer's. ``max |Δ|`` compares every output
with the loop's. ``--profile`` adds where the fused layer's time goes: the kernels of a few
forward+backward steps (:func:`lmfs.bench.timing.profile_table`), the longest first, µs per
step, with what each of the fused layer's own kernels achieved (TFLOP/s of its matmuls, or GB/s
moved by the combine), the tile shapes the autotuner picked for them, and what it measured for
every candidate of the three fused matmul kernels (a tile that spills shows up there as slow).
Without a GPU a tiny shape runs through Triton's interpreter, to exercise the code; those numbers
say nothing about real hardware.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import asdict, dataclass

import torch

from lmfs.bench import save_json
from lmfs.bench.timing import benchmark, profile_table
from lmfs.kernels import INTERPRET
from lmfs.kernels.grouped_gemm import autotune_choices, grouped_matmul, torch_grouped_matmul, torch_grouped_mm
from lmfs.kernels.moe import autotune_choices as fused_choices
from lmfs.kernels.moe import autotune_timings as fused_timings
from lmfs.kernels.moe import use_fused_moe
from lmfs.nn.layers import GatedMLP
from lmfs.nn.moe import MoE


@dataclass(frozen=True)
class MoEShape:
    d_model: int
    experts: int
    width: int  # of each routed expert
    top_k: int
    shared: int  # shared experts, each of the routed experts' width
    tokens: int

    @property
    def active_width(self) -> int:
        """Hidden units each token passes through: k routed experts plus the shared ones."""
        return (self.top_k + self.shared) * self.width

    def flops(self) -> float:
        """Forward + backward matmul FLOPs of the layer for all tokens (3 × the forward's)."""
        return 3 * self.tokens * (6 * self.d_model * self.active_width + 2 * self.d_model * self.experts)


GPU_SHAPE = MoEShape(d_model=1024, experts=64, width=512, top_k=8, shared=1, tokens=16384)
CPU_SHAPE = MoEShape(d_model=32, experts=8, width=16, top_k=2, shared=1, tokens=48)


def make_moe(shape: MoEShape, device, dtype, seed: int = 0) -> MoE:
    """The layer of ``shape`` with seeded weights; ``moe.experts.matmul`` picks the grouped matmul."""
    torch.manual_seed(seed)
    moe = MoE(shape.d_model, shape.width, shape.experts, shape.top_k, n_shared=shape.shared)
    return moe.to(device=device, dtype=dtype)


def moe_call(moe: MoE, x: torch.Tensor, dispatch: str, matmul=None):
    """A function running ``moe(x)`` with ``dispatch`` and, for the sorted one, ``matmul``."""

    def call():
        moe.dispatch = dispatch
        if matmul is not None:
            moe.experts.matmul = matmul
        return moe(x)

    return call


def hf_block(moe: MoE, implementation: str):
    """Hugging Face's Qwen2-MoE sparse block holding the weights of ``moe`` (copied)."""
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    E, d, width = moe.experts.w_gate.shape
    config = Qwen2MoeConfig(hidden_size=d, num_experts=E, num_experts_per_tok=moe.top_k,
                            moe_intermediate_size=width, shared_expert_intermediate_size=moe.shared.up.weight.shape[0],
                            norm_topk_prob=False, hidden_act="silu")
    config._experts_implementation = implementation
    w = moe.experts.w_gate
    block = Qwen2MoeSparseMoeBlock(config).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():  # HF stores (out, in) matrices; the experts' are (in, out)
        block.gate.weight.copy_(moe.router.proj.weight)
        block.experts.gate_up_proj.copy_(torch.cat([moe.experts.w_gate, moe.experts.w_up], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(moe.experts.w_down.transpose(1, 2))
        block.shared_expert.gate_proj.weight.copy_(moe.shared.gate.weight)
        block.shared_expert.up_proj.weight.copy_(moe.shared.up.weight)
        block.shared_expert.down_proj.weight.copy_(2 * moe.shared.down.weight)  # times sigmoid(0) = ½
        block.shared_expert_gate.weight.zero_()
    return block


def _fwdbwd_seconds(fn, inputs: list, grad_out, device, warmup: int, repeats: int) -> float:
    return benchmark(lambda: torch.autograd.grad(fn(), inputs, grad_out), warmup, repeats, device).median


def run(shape: MoEShape | None = None, device=None, warmup: int | None = None, repeats: int | None = None,
        hf: bool = True, profile: bool = False) -> dict:
    """Time the six implementations; print the table (and with ``profile`` the fused layer's
    kernels); return the numbers."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    shape = shape or (GPU_SHAPE if cuda else CPU_SHAPE)
    dtype = torch.bfloat16 if cuda else torch.float32
    warmup = warmup if warmup is not None else (3 if cuda else 0)  # the interpreter compiles nothing
    repeats = repeats if repeats is not None else (10 if cuda else 2)
    if not cuda:
        print("no CUDA GPU: a tiny shape, the Triton kernel through its interpreter; real numbers need a CUDA GPU")
    moe = make_moe(shape, device, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.tokens, shape.d_model, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad_out = torch.randn(shape.tokens, shape.d_model, generator=gen).to(device=device, dtype=dtype)
    inputs = [x, *moe.parameters()]
    with torch.no_grad():
        expected = moe_call(moe, x, "loop")()

    impls = {"loop": (moe_call(moe, x, "loop"), inputs),
             "lmfs triton": (moe_call(moe, x, "sorted", grouped_matmul), inputs)}
    notes = {}
    fused = use_fused_moe(copy.deepcopy(moe))  # the same weights, the fused kernels
    impls["lmfs fused"] = (moe_call(fused, x, "sorted"), [x, *fused.parameters()])
    if torch_grouped_mm() is not None:
        impls["torch grouped_mm"] = (moe_call(moe, x, "sorted", torch_grouped_matmul), inputs)
    else:
        notes["torch grouped_mm"] = f"torch {torch.__version__} has no grouped matmul"
    if hf:
        impls.update(_hf_impls(shape, moe, x, notes))
    dense = GatedMLP(shape.d_model, shape.active_width).to(device=device, dtype=dtype)
    impls["dense SwiGLU"] = (lambda: dense(x), [x, *dense.parameters()])

    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "dtype": str(dtype).replace("torch.", ""),
              "interpreter": INTERPRET, "shape": asdict(shape), "flops": shape.flops(), "rows": {}, "notes": notes}
    for name, (fn, inputs) in impls.items():
        try:
            with torch.no_grad():
                out = fn()
            diff = None if name == "dense SwiGLU" else (out.float() - expected.float()).abs().max().item()
            seconds = _fwdbwd_seconds(fn, inputs, grad_out, device, warmup, repeats)
        except Exception as err:  # e.g. a grouped matmul refusing this device: note it, time the others
            notes[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            if cuda:
                torch.cuda.empty_cache()
            continue
        result["rows"][name] = {"seconds": seconds, "tokens_per_s": shape.tokens / seconds,
                                "tflops": shape.flops() / seconds / 1e12, "max_abs_diff": diff}
        print(f"  timed {name}", file=sys.stderr, flush=True)
    _pick_fastest_hf(result)
    result["ratios"] = _ratios(result["rows"])
    result["configs"] = autotune_choices()
    result["fused_configs"] = fused_choices()
    if profile and "lmfs fused" in result["rows"]:
        fn, fused_inputs = impls["lmfs fused"]
        table = profile_table(lambda: torch.autograd.grad(fn(), fused_inputs, grad_out), warmup=1 if cuda else 0,
                              repeats=3 if cuda else 1, row_limit=25)
        table["rate"] = [_rate(shape, name, mean_us, x.element_size())
                         for name, mean_us in zip(table["name"], table["mean_us"])]
        result["profile"] = table.to_dict(orient="records")
        result["profile_where"] = table.attrs["where"]
        result["fused_timings"] = fused_timings()
    _print(result)
    return result


def _kernel_work(shape: MoEShape, elem: int) -> dict[str, tuple[str, float]]:
    """Per launch of each fused-layer kernel: its matmul FLOPs, or for the combine kernel the
    bytes it moves at least (``elem`` bytes an element; no dropping, so A = tokens·k rows)."""
    A, T, d, w = shape.tokens * shape.top_k, shape.tokens, shape.d_model, shape.width
    matmul = 2 * A * d * w  # one (A, d) x (d, w) grouped product
    return {"moe_up_kernel": ("TFLOP/s", 2 * matmul),            # gate and up
            "moe_up_dx_kernel": ("TFLOP/s", 2 * matmul),         # dg·W_gateᵀ + du·W_upᵀ
            "moe_down_dx_kernel": ("TFLOP/s", matmul),
            "grouped_matmul_kernel": ("TFLOP/s", matmul),        # the down projection
            "grouped_matmul_dw_kernel": ("TFLOP/s", matmul),     # each of the three weight gradients
            "moe_combine_kernel": ("GB/s", (A + T) * d * elem)}  # read y (or dx sorted), write out


def _rate(shape: MoEShape, name: str, mean_us: float, elem: int) -> str:
    """What a profiled kernel achieved per launch ('' for kernels not in :func:`_kernel_work`).
    Matched by prefix, the longest first: some Triton versions append a signature to the name."""
    work = _kernel_work(shape, elem)
    key = next((k for k in sorted(work, key=len, reverse=True) if name.startswith(k)), None)
    if key is None or not mean_us:
        return ""
    unit, work = work[key]
    per_s = work / (mean_us * 1e-6)
    return f"{per_s / 1e12:.0f} TFLOP/s" if unit == "TFLOP/s" else f"{per_s / 1e9:,.0f} GB/s"


def _hf_impls(shape: MoEShape, moe: MoE, x: torch.Tensor, notes: dict) -> dict:
    """HF's block under each expert implementation that can run here."""
    try:
        import transformers.models.qwen2_moe.modeling_qwen2_moe  # noqa: F401
    except ImportError as err:
        notes["HF Qwen2-MoE"] = f"transformers' Qwen2-MoE not importable: {err}"
        return {}
    impls = {}
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        if implementation == "batched_mm":  # gathers one weight matrix per (token, expert) pair
            gathered = shape.tokens * shape.top_k * 2 * shape.width * shape.d_model * x.element_size()
            if x.is_cuda and gathered > 0.5 * torch.cuda.mem_get_info(x.device)[0]:
                notes["HF batched_mm"] = f"left out: it would gather {gathered / 2**30:.0f} GiB of weights"
                continue
        block = hf_block(moe, implementation)
        impls[f"HF {implementation}"] = (lambda b=block: b(x[None])[0], [x, *block.parameters()])
    return impls


def _pick_fastest_hf(result: dict) -> None:
    hf_rows = {name: row for name, row in result["rows"].items() if name.startswith("HF ")}
    if hf_rows:
        result["hf_fastest"] = min(hf_rows, key=lambda name: hf_rows[name]["seconds"])


def _ratios(rows: dict) -> dict:
    ratios = {}
    hf = min((r["seconds"] for name, r in rows.items() if name.startswith("HF ")), default=None)
    for name in ("lmfs fused", "lmfs triton", "torch grouped_mm"):
        if name not in rows:
            continue
        r = rows[name]
        if "loop" in rows:
            ratios[f"{name} / loop"] = r["tokens_per_s"] / rows["loop"]["tokens_per_s"]
        if hf is not None:
            ratios[f"{name} / HF fastest"] = hf / r["seconds"]
        if "dense SwiGLU" in rows:
            ratios[f"{name} TFLOP/s / dense"] = r["tflops"] / rows["dense SwiGLU"]["tflops"]
    return ratios


def _print(result: dict) -> None:
    import pandas as pd

    s = result["shape"]
    print(f"\nMoE layer forward+backward, {result['dtype']} on {result['device']}: d_model {s['d_model']}, "
          f"{s['experts']} experts of width {s['width']}, top-{s['top_k']}, {s['shared']} shared, "
          f"{s['tokens']} tokens; {result['flops'] / 1e12:.3g} TFLOP counted per step")
    rows = [{"implementation": name, "ms": f"{r['seconds'] * 1e3:.3g}", "tokens/s": f"{r['tokens_per_s']:,.0f}",
             "TFLOP/s": f"{r['tflops']:.3g}",
             "max |Δ| vs loop": "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"}
            for name, r in result["rows"].items()]
    print(pd.DataFrame(rows).to_string(index=False))
    if "hf_fastest" in result:
        print(f"HF fastest: {result['hf_fastest']}")
    for name, value in result["ratios"].items():
        print(f"  {name}: {value:.3g}x")
    for name, note in result["notes"].items():
        print(f"  ({name}: {note})")
    print(f"  grouped_matmul blocks: {result['configs']}")
    print(f"  fused kernels' blocks: {result['fused_configs']}")
    if "profile" in result:
        print(f"\nprofile of lmfs fused, forward+backward: {result['profile_where']} per step, the longest first")
        print(pd.DataFrame(result["profile"]).to_string(index=False, formatters={
            "name": lambda n: n[:90], "total_us": "{:,.0f}".format, "mean_us": "{:,.1f}".format,
            "share": "{:.1%}".format}))
        for name, timings in result["fused_timings"].items():
            if timings:
                print(f"  autotuner's candidates for the fused {name} kernel, ms: "
                      + "; ".join(f"{config} {ms:.3f}" for config, ms in timings.items()))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="MoE dispatch: loop vs grouped matmuls (lmfs Triton, torch) vs "
                                                 "Hugging Face Qwen2-MoE vs dense SwiGLU, forward+backward tokens/s")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step (default 16384 on a GPU, 48 on the CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 10 on a GPU, 2 on the CPU)")
    parser.add_argument("--no-hf", action="store_true", help="leave out Hugging Face's block")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--profile", action="store_true",
                        help="also print the fused layer's longest kernels (torch.profiler), µs per step")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    if args.tokens is not None:
        shape = MoEShape(**{**asdict(shape), "tokens": args.tokens})
    result = run(shape, device, repeats=args.repeats, hf=not args.no_hf, profile=args.profile)
    save_json(result, args.json)
    return result

"""The one dataclass that describes a transformer LM, and its parameter count in closed form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmfs.nn.layers import FFN_KINDS, GATED_FFNS, default_d_ff, ffn_params, norm_params
from lmfs.nn.moe import DISPATCHES, ROUTERS
from lmfs.nn.positions import POSITION_KINDS

CHOICES = {
    "norm": ("rms", "layer"),
    "norm_position": ("pre", "post", "double"),
    "ffn": FFN_KINDS,
    "positions": POSITION_KINDS,
    "attention": ("mha", "mla"),
    "attn_impl": ("sdpa", "reference"),
    "moe_router": ROUTERS,
    "moe_dispatch": DISPATCHES,
}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class TransformerConfig:
    """Every architectural choice of :class:`lmfs.nn.TransformerLM`, validated on creation.

    ``None`` means "the usual default", resolved by the properties ``kv_heads`` (``n_heads``,
    i.e. MHA) and ``ffn_dim`` (see :func:`lmfs.nn.layers.default_d_ff`). Keeping ``None`` rather
    than filling it in means ``dataclasses.replace(cfg, ffn="relu")`` picks the right width again.
    The defaults describe a small Llama-style model: RMSNorm, pre-norm, SwiGLU, RoPE, no biases.
    """

    vocab_size: int = 256
    context_length: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None       # None: = n_heads (MHA); 1: MQA; in between: GQA
    d_ff: int | None = None             # None: 4·d_model plain, 8/3·d_model up to a multiple of 64 gated
    norm: str = "rms"                   # "rms" | "layer"
    norm_eps: float = 1e-5
    norm_position: str = "pre"          # "pre" | "post" | "double" (sandwich)
    parallel: bool = False              # attention and MLP read the same normed input and are summed
    ffn: str = "swiglu"                 # "swiglu" | "geglu" | "relu" | "gelu"
    positions: str = "rope"             # "rope" | "learned" | "sinusoidal" | "none"
    rope_theta: float = 10000.0
    qk_norm: bool = False
    logit_softcap: float | None = None  # final logits → cap·tanh(logits/cap)
    attn_softcap: float | None = None   # attention logits → cap·tanh(logits/cap)
    window: int | None = None           # sliding-window attention span, in tokens (itself included)
    attention: str = "mha"              # "mha" (also GQA/MQA via n_kv_heads) | "mla"
    kv_latent_dim: int | None = None    # MLA only: width of the compressed K/V latent
    tie_embeddings: bool = True         # the output projection reuses the token embedding matrix
    z_loss: float = 0.0                 # weight of mean(logsumexp(logits)²) added to the loss
    bias: bool = False                  # biases in the linear layers (never in the output head)
    init_std: float = 0.02
    attn_impl: str = "sdpa"             # "sdpa" (fused) | "reference"; attn_softcap forces reference
    # Mixture of experts (lmfs.nn.moe): the feed-forward of every moe_every-th layer becomes an MoE.
    moe_experts: int = 0                # routed experts per MoE layer; 0: a dense model
    moe_top_k: int = 2                  # experts per token
    moe_every: int = 1                  # layers moe_every-1, 2·moe_every-1, ... are MoE (1: all)
    moe_expert_dim: int | None = None   # width of one expert; None: ffn_dim (smaller: fine-grained)
    moe_shared_experts: int = 0         # always-on experts of width moe_expert_dim (DeepSeekMoE)
    moe_router: str = "softmax_topk"    # see lmfs.nn.moe.Router
    moe_capacity_factor: float | None = None  # None: no token dropping
    moe_dispatch: str = "sorted"        # "sorted" (grouped) | "loop" (per expert): the same result
    moe_aux_loss: float = 0.01          # weight of the Switch balance loss, per MoE layer
    moe_device_loss: float = 0.0        # weight of the per-device balance loss over moe_devices groups
    moe_devices: int = 1
    moe_z_loss: float = 0.0             # weight of the router z-loss (ST-MoE uses 1e-3)
    moe_bias_rate: float = 0.0          # sigmoid router's loss-free bias step (DeepSeek-V3: 1e-3)

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError("invalid TransformerConfig:\n  - " + "\n  - ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        return default_d_ff(self.d_model, self.ffn) if self.d_ff is None else self.d_ff

    @property
    def moe_dim(self) -> int:
        """The width of one expert: ``moe_expert_dim``, or the dense feed-forward's ``ffn_dim``."""
        return self.ffn_dim if self.moe_expert_dim is None else self.moe_expert_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE feed-forward: every ``moe_every``-th one."""
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0

    def num_params(self, active: bool = False) -> int:
        """Parameters of a model built from this config; see :func:`count_params`."""
        return count_params(self, active)

    def problems(self) -> list[str]:
        """Every inconsistency in this config, each phrased with the change that fixes it."""
        out = []
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)} must be a positive integer")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                out.append(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if out:  # the checks below assume sane sizes and known choices
            return out

        if self.d_model % self.n_heads:
            out.append(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                       f"use n_heads in {_divisors(self.d_model)[:12]} or change d_model")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            out.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}: "
                       f"use n_kv_heads in {_divisors(self.n_heads)} (or None for MHA)")
        if self.positions == "rope" and self.head_dim % 2:
            out.append(f"RoPE needs an even head_dim, got d_model/n_heads={self.head_dim}: "
                       "change d_model or n_heads, or pick other positions")
        if self.positions == "sinusoidal" and self.d_model % 2:
            out.append(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.d_ff is not None and self.d_ff < 1:
            out.append(f"d_ff={self.d_ff} must be positive (or None for the default width)")
        if self.attention == "mla" and (self.kv_latent_dim is None or self.kv_latent_dim < 1):
            out.append("attention='mla' needs kv_latent_dim, a positive latent width "
                       f"(e.g. {max(self.d_model // 4, 1)})")
        if self.attention == "mha" and self.kv_latent_dim is not None:
            out.append("kv_latent_dim is only used by MLA: set attention='mla' or kv_latent_dim=None")
        for name in ("logit_softcap", "attn_softcap", "window"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                out.append(f"{name}={value} must be positive, or None to switch it off")
        for name in ("norm_eps", "rope_theta", "init_std"):
            if getattr(self, name) <= 0:
                out.append(f"{name}={getattr(self, name)} must be positive")
        if self.z_loss < 0:
            out.append(f"z_loss={self.z_loss} must be >= 0 (0 switches it off)")
        return out + self.moe_problems()

    def moe_problems(self) -> list[str]:
        """The checks of the ``moe_*`` fields (none apply to a dense model, ``moe_experts=0``)."""
        E, k = self.moe_experts, self.moe_top_k
        if E < 0:
            return [f"moe_experts={E} must be >= 0 (0 for a dense model)"]
        if E == 0:
            return []
        out = []
        if not 1 <= k <= E:
            out.append(f"moe_top_k={k} must be between 1 and moe_experts={E}: a token cannot use more "
                       "experts than there are")
        if not 1 <= self.moe_every <= self.n_layers:
            out.append(f"moe_every={self.moe_every} must be between 1 (every layer) and n_layers={self.n_layers}")
        if self.moe_expert_dim is not None and self.moe_expert_dim < 1:
            out.append(f"moe_expert_dim={self.moe_expert_dim} must be positive (or None for ffn_dim)")
        if self.moe_shared_experts < 0:
            out.append(f"moe_shared_experts={self.moe_shared_experts} must be >= 0")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            out.append(f"moe_capacity_factor={self.moe_capacity_factor} must be > 0 (1.25 is usual), "
                       "or None for no token dropping")
        if self.ffn not in GATED_FFNS:
            out.append(f"MoE experts are gated MLPs: use ffn in {GATED_FFNS} (got {self.ffn!r})")
        if self.bias:
            out.append("MoE layers have no biases: set bias=False")
        if self.moe_devices < 1 or E % self.moe_devices:
            out.append(f"moe_devices={self.moe_devices} must divide moe_experts={E}: "
                       f"use one of {_divisors(E)}")
        for name in ("moe_aux_loss", "moe_device_loss", "moe_z_loss", "moe_bias_rate"):
            if getattr(self, name) < 0:
                out.append(f"{name}={getattr(self, name)} must be >= 0 (0 switches it off)")
        if self.moe_bias_rate > 0 and self.moe_router != "sigmoid":
            out.append(f"moe_bias_rate is the loss-free balancing of the sigmoid router: set "
                       f"moe_router='sigmoid' or moe_bias_rate=0 (got moe_router={self.moe_router!r})")
        return out


def layer_config(config: TransformerConfig | None, fields: dict) -> TransformerConfig:
    """The config one layer is built from: ``config`` with ``fields`` replaced, or, without a
    config, ``TransformerConfig(**fields)`` (so ``CausalSelfAttention(d_model=64, n_heads=4)``
    needs no model around it; every field left out keeps its default)."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(TransformerConfig)}
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}: a layer takes the fields of TransformerConfig "
                        "(d_model, n_heads, n_kv_heads, ...)")
    return TransformerConfig(**fields) if config is None else dataclasses.replace(config, **fields)


def moe_params(config: TransformerConfig, active: bool = False) -> int:
    """Parameters of one MoE feed-forward: router, routed experts, shared experts.

    ``active``: only those one token uses, i.e. ``moe_top_k`` routed experts instead of all.
    """
    c = config
    expert = ffn_params(c.ffn, c.d_model, c.moe_dim, False)
    router = 0 if c.moe_router == "hash" else c.d_model * c.moe_experts
    shared = ffn_params(c.ffn, c.d_model, c.moe_shared_experts * c.moe_dim, False) if c.moe_shared_experts else 0
    return router + (c.moe_top_k if active else c.moe_experts) * expert + shared


def count_params(config: TransformerConfig, active: bool = False) -> int:
    """The number of trainable parameters of ``TransformerLM(config)``, from the config alone.

    Tied embeddings are one matrix and count once. RoPE and sinusoidal positions have no
    parameters (the sinusoidal table is a buffer), so they add nothing. ``active``: of an MoE
    model, only the parameters one token uses (``moe_top_k`` of the routed experts, every
    shared expert, the router); the same as the total for a dense model.
    """
    c = config
    d, hd, H, KV, b = c.d_model, c.head_dim, c.n_heads, c.kv_heads, int(c.bias)

    attn = d * H * hd + b * H * hd                          # q_proj
    kv_in = d
    if c.attention == "mla":
        L = c.kv_latent_dim
        attn += d * L + b * L + norm_params(c.norm, L)     # kv_down and the latent's norm
        kv_in = L
    attn += 2 * (kv_in * KV * hd + b * KV * hd)             # k_proj, v_proj
    attn += H * hd * d + b * d                              # o_proj
    attn += 2 * hd if c.qk_norm else 0                      # q_norm, k_norm (one gain each)

    branches = 1 if c.parallel else 2                      # residual branches per block
    norms = branches * norm_params(c.norm, d) * (2 if c.norm_position == "double" else 1)
    per_layer = attn + norms
    ffns = sum(moe_params(c, active) if c.is_moe_layer(i) else ffn_params(c.ffn, d, c.ffn_dim, c.bias)
               for i in range(c.n_layers))

    total = c.n_layers * per_layer + ffns + c.vocab_size * d  # blocks + token embedding
    total += c.context_length * d if c.positions == "learned" else 0
    total += norm_params(c.norm, d) if c.norm_position != "post" else 0  # final norm
    total += 0 if c.tie_embeddings else c.vocab_size * d   # separate output head
    return total

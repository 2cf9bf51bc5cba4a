"""Mixture of experts: more parameters for the same FLOPs per token.

An MoE feed-forward holds ``E`` expert MLPs and a router. Each token goes to only ``k`` of them, so
the layer has ``E`` experts' parameters but costs a token ``k`` experts' FLOPs. One forward:

1. **route**: the router scores every (token, expert) pair in float32 and picks assignments
   ``(token, expert, weight)`` (:class:`Router`; token choice, expert choice or hashing);
2. **capacity**: an expert takes at most ``ceil(capacity_factor · tokens·k / E)`` assignments; the
   rest are dropped (their tokens pass through the residual only) — or nothing is dropped when
   ``capacity_factor`` is None;
3. **dispatch**: every expert runs on its tokens, written two ways with the same result:
   ``"loop"`` (for each expert, gather its tokens, run it, scatter-add the weighted outputs: the
   idea) and ``"sorted"`` (sort the assignments by expert, run all experts as one grouped
   computation over contiguous segments (:meth:`Experts.forward`), then combine);
4. **combine**: each token sums its experts' outputs times the router weights, plus the shared
   (always-on) experts, if any.

Balancing (:func:`switch_loss`, :func:`router_z_loss`, the per-device loss, the bias of
:meth:`Router.update_bias`) and load statistics are computed on every forward and kept on the
layer (``moe.aux``, ``moe.stats``); the model decides how much of each goes into its loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmfs.nn.layers import GATED_FFNS, GatedMLP, Linear

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid", "expert_choice", "hash")
TOKEN_CHOICE = ("softmax_topk", "topk_softmax", "sigmoid")
DISPATCHES = ("loop", "sorted")
# A fixed odd multiplier (Knuth's multiplicative hash): spreads consecutive token ids over experts.
_HASH_MULTIPLIER = 2654435761


def capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert may take: ``ceil(capacity_factor · tokens·k / E)``; None = no limit.

    ``tokens·k / E`` is an expert's share under perfectly uniform routing; a factor above 1 leaves
    room for imbalance, below 1 drops tokens even when the load is uniform.
    """
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0, or None for no dropping")
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def switch_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``E · Σ_i f_i · P_i``.

    ``probs`` ``(N, E)``: the router's probabilities per token; ``counts`` ``(E,)``: assignments
    per expert. ``f_i`` is expert ``i``'s fraction of the assignments (not differentiable: it
    comes from an argmax), ``P_i`` its mean probability (differentiable). When the loads follow
    the probabilities (``f = P``) the loss is ``E · Σ P_i² ≥ 1``, with equality only at uniform
    load ``f = P = 1/E``; the gradient pushes ``P`` down where ``f`` is large.
    """
    f = counts.float() / counts.sum().clamp(min=1)
    P = probs.float().mean(0)
    return probs.shape[-1] * (f * P).sum()


def device_balance_loss(probs: torch.Tensor, counts: torch.Tensor, n_devices: int) -> torch.Tensor:
    """:func:`switch_loss` over groups of experts: the ``E/n_devices`` experts of each device
    (contiguous, as expert parallelism places them) pooled into one. Balances the devices' work
    while leaving the experts within one device free to specialise (DeepSeek-V2)."""
    E = probs.shape[-1]
    if E % n_devices:
        raise ValueError(f"{E} experts do not split over {n_devices} devices: use a divisor of {E}")
    return switch_loss(probs.reshape(-1, n_devices, E // n_devices).sum(-1),
                       counts.reshape(n_devices, -1).sum(-1))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss ``mean_tokens(logsumexp(logits)²)``: keeps router logits small, where
    float rounding in the softmax does no harm. ``logits`` ``(N, E)``."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def bin_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``(n,)`` int64: how often each of ``0 .. n-1`` occurs in the integer ``ids``, like
    ``torch.bincount(ids, minlength=n)``.

    Not bincount itself: on a GPU it reads the largest id back to size its output, so the host
    stops queueing work until the GPU catches up, every forward. A histogram with ``n`` unit-wide
    bins over ``[0, n)`` has one bin per id, and float64 holds every id and every count exactly
    (below 2⁵³). On a GPU it counts in each block's shared memory first; adding ones straight
    into ``n`` counters in global memory, with ``n`` = E a few dozen, makes every atomic add wait
    on the same few addresses. (``torch.use_deterministic_algorithms`` refuses ``histc`` on a GPU,
    although integer counts come out the same in any order: pass ``warn_only=True`` there.)
    """
    return torch.histc(ids.double(), bins=n, min=0, max=n).long()


@dataclass
class Routing:
    """Where tokens go: assignment ``a`` sends token ``token[a]`` to expert ``expert[a]`` with
    weight ``weight[a]`` (each ``(A,)``). ``probs`` ``(N, E)`` and ``logits`` ``(N, E)`` feed the
    balancing losses (None for hash routing, which has no router). ``load`` ``(E,)``: assignments
    per expert, where the router counted them already (else the layer counts them)."""

    token: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor
    probs: torch.Tensor | None
    logits: torch.Tensor | None
    load: torch.Tensor | None = None


class Router(nn.Module):
    """Scores tokens against experts and returns a :class:`Routing`; ``x`` is ``(N, d_model)``.

    ``kind``:

    * ``"softmax_topk"``: softmax over all experts, keep the top ``k`` probabilities as weights
      (Switch, DeepSeek-V2). The weights sum to less than 1, and with ``k = 1`` the router still
      gets a gradient from the model's loss through its one weight.
    * ``"topk_softmax"``: keep the top ``k`` logits, softmax over those (Mixtral). The weights sum
      to 1; with ``k = 1`` the weight is always 1 and only the auxiliary losses train the router.
    * ``"sigmoid"``: an independent sigmoid gate per expert; a per-expert ``bias`` is added for
      *selection only*, the chosen gates are normalised to sum to 1 (DeepSeek-V3). Instead of an
      auxiliary loss, :meth:`update_bias` nudges the bias after each step toward uniform load.
    * ``"expert_choice"``: every expert picks its top ``capacity`` tokens by softmax score (Zhou et
      al. 2022): perfectly balanced, but a token may get any number of experts, even none; the
      choice looks at the whole batch, so a causal LM's token sees its future.
    * ``"hash"``: a fixed hash of the token id picks ``k`` consecutive experts, weight ``1/k``
      each (Roller et al. 2021): no parameters, no learning, a baseline for the learned routers.

    The logits are computed in float32 even under autocast: the softmax's and top-k's decisions
    are sensitive to rounding, and bfloat16 logits flip choices from step to step.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int = 1, kind: str = "softmax_topk",
                 bias_rate: float = 0.0):
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"unknown router {kind!r}: use one of {ROUTERS}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({n_experts})")
        if bias_rate and kind != "sigmoid":
            raise ValueError(f"bias_rate={bias_rate} is the auxiliary-loss-free method of the 'sigmoid' "
                             f"router: use kind='sigmoid' or bias_rate=0")
        self.kind, self.n_experts, self.top_k, self.bias_rate = kind, n_experts, top_k, bias_rate
        self.proj = None if kind == "hash" else Linear(d_model, n_experts)
        if kind == "sigmoid":
            self.register_buffer("bias", torch.zeros(n_experts))
        self.load_since_update = torch.zeros(n_experts, dtype=torch.long)  # for update_bias

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, d_model)`` -> float32 ``(N, E)``, autocast switched off so it stays float32."""
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ self.proj.weight.float().T

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                capacity_factor: float | None = None) -> Routing:
        N, E, k = x.shape[0], self.n_experts, self.top_k
        if self.kind == "hash":
            if token_ids is None:
                raise ValueError("hash routing needs the token ids: call moe(x, token_ids) "
                                 "(TransformerLM passes them) or pick a learned router")
            first = (token_ids.reshape(-1).long() * _HASH_MULTIPLIER) % (2 ** 32) % E
            expert = (first[:, None] + torch.arange(k, device=x.device)) % E            # (N, k)
            weight = torch.full((N, k), 1.0 / k, device=x.device)
            return _token_choice(expert, weight, None, None)

        logits = self.logits(x)                                                           # (N, E)
        probs = torch.softmax(logits, dim=-1)
        if self.kind == "softmax_topk":
            weight, expert = probs.topk(k, dim=-1)
        elif self.kind == "topk_softmax":
            top, expert = logits.topk(k, dim=-1)
            weight = torch.softmax(top, dim=-1)
        elif self.kind == "sigmoid":
            gates = torch.sigmoid(logits)
            expert = (gates + self.bias).topk(k, dim=-1).indices   # the bias steers selection only
            weight = gates.gather(-1, expert)
            weight = weight / weight.sum(-1, keepdim=True)
            probs = gates / gates.sum(-1, keepdim=True)           # for the (optional) balance losses
        else:  # expert_choice: experts pick tokens; capacity defaults to the uniform share
            C = min(N, capacity(N, k, E, 1.0 if capacity_factor is None else capacity_factor))
            score, token = probs.topk(C, dim=0)                                           # (C, E)
            expert = torch.arange(E, device=x.device).expand(C, E)
            return Routing(token.reshape(-1), expert.reshape(-1), score.reshape(-1), probs, logits)
        return _token_choice(expert, weight, probs, logits)

    @torch.no_grad()
    def update_bias(self) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step:
        ``bias += rate · sign(mean_load - load)`` over the load counted since the last update, so
        overloaded experts get picked less and underloaded ones more. A no-op for other routers."""
        if self.kind != "sigmoid" or not self.bias_rate:
            return
        load = self.load_since_update.to(self.bias.device).float()
        self.bias += self.bias_rate * torch.sign(load.mean() - load)
        self.load_since_update = torch.zeros_like(self.load_since_update)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, n_experts={self.n_experts}, top_k={self.top_k}"


def _token_choice(expert: torch.Tensor, weight: torch.Tensor, probs, logits) -> Routing:
    """``(N, k)`` choices -> assignments ordered choice-major (every token's first choice, then
    every token's second, ...), the order in which capacity is handed out: a second choice is
    dropped before anyone's first (GShard)."""
    N, k = expert.shape
    token = torch.arange(N, device=expert.device).repeat(k)
    return Routing(token, expert.T.reshape(-1), weight.T.reshape(-1), probs, logits)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` ``(A, d_in)`` come in ``G`` contiguous groups of ``group_sizes`` ``(G,)`` rows;
    group ``g`` is multiplied by ``w[g]`` ``(d_in, d_out)``; returns ``(A, d_out)``.

    PyTorch's grouped matmul does all groups in one kernel where it can (bfloat16 on a CUDA GPU,
    16-byte-aligned widths); elsewhere a loop over the segments computes the same thing.
    """
    grouped = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if x.is_cuda and torch.is_autocast_enabled("cuda"):  # autocast skips grouped_mm: cast as it would
        x = x.to(torch.get_autocast_dtype("cuda"))
    if (grouped is not None and x.is_cuda and x.dtype == torch.bfloat16
            and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0):
        return grouped(x, w.to(x.dtype), offs=group_sizes.cumsum(0).to(torch.int32))
    segments = x.split(group_sizes.tolist())
    return torch.cat([seg @ w[g].to(seg.dtype) for g, seg in enumerate(segments)])


class Experts(nn.Module):
    """``E`` gated-MLP experts (SwiGLU, or GeGLU) with their weights stacked: ``w_gate`` and
    ``w_up`` ``(E, d_model, d_ff)``, ``w_down`` ``(E, d_ff, d_model)``.

    Stacked rather than a list of :class:`~lmfs.nn.GatedMLP`, so that all experts run as one
    grouped matmul. The layout is ``(in, out)`` per expert (``x @ w[e]``), what grouped-matmul
    kernels take. Fine-grained experts (DeepSeekMoE) are the same class with a smaller ``d_ff``
    and more experts. ``forward`` is the whole grouped computation, the one method a faster
    kernel replaces (as :mod:`lmfs.kernels.fused` swaps module classes, keeping the parameters).
    Its three grouped matmuls call ``self.matmul``, :func:`grouped_matmul` by default; an opt-in
    sets another function of the same signature (:func:`lmfs.kernels.grouped_gemm.use_triton_experts`).
    """

    matmul = staticmethod(grouped_matmul)

    def __init__(self, n_experts: int, d_model: int, d_ff: int, activation: str = "swiglu"):
        super().__init__()
        if activation not in GATED_FFNS:
            raise ValueError(f"experts are gated MLPs: activation must be one of {GATED_FFNS}, got {activation!r}")
        self.activation = activation
        self.act = F.silu if activation == "swiglu" else F.gelu
        self.w_gate = nn.Parameter(torch.randn(n_experts, d_model, d_ff) / math.sqrt(d_model))
        self.w_up = nn.Parameter(torch.randn(n_experts, d_model, d_ff) / math.sqrt(d_model))
        self.w_down = nn.Parameter(torch.randn(n_experts, d_ff, d_model) / math.sqrt(d_ff))

    @property
    def n_experts(self) -> int:
        return self.w_gate.shape[0]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` alone on its tokens ``(n, d_model)`` -> ``(n, d_model)``."""
        return (self.act(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]

    def forward(self, x_sorted: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """All experts at once: ``x_sorted`` ``(A, d_model)`` holds expert 0's rows, then expert 1's,
        ...; ``group_sizes`` ``(E,)`` counts them. Returns ``(A, d_model)`` in the same order."""
        h = self.act(self.matmul(x_sorted, self.w_gate, group_sizes))
        h = h * self.matmul(x_sorted, self.w_up, group_sizes)
        return self.matmul(h, self.w_down, group_sizes)

    def sliced(self, first: int, count: int) -> Experts:
        """A new :class:`Experts` with copies of experts ``first .. first+count-1`` (expert parallelism)."""
        out = Experts(count, self.w_gate.shape[1], self.w_gate.shape[2], self.activation)
        with torch.no_grad():
            for name in ("w_gate", "w_up", "w_down"):
                getattr(out, name).copy_(getattr(self, name)[first:first + count])
        return out.to(self.w_gate.device)

    def per_expert_state(self, first: int = 0) -> dict[str, torch.Tensor]:
        """``{"{e}.w_gate": (d_model, d_ff), ...}`` with global expert numbers ``first + j``: one
        expert's weights under one name, so states of experts held on different ranks merge."""
        return {f"{first + j}.{name}": getattr(self, name)[j].detach().clone()
                for j in range(self.n_experts) for name in ("w_gate", "w_up", "w_down")}

    def extra_repr(self) -> str:
        E, d, f = self.w_gate.shape
        return f"n_experts={E}, d_model={d}, d_ff={f}, activation={self.activation!r}"


class MoE(nn.Module):
    """A mixture-of-experts feed-forward: ``x`` ``(..., d_model)`` -> ``(..., d_model)``.

    ``n_experts`` routed experts of width ``d_expert`` of which each token uses ``top_k`` (see
    :class:`Router` for ``router``), plus ``n_shared`` always-on experts, merged into one
    :class:`~lmfs.nn.GatedMLP` of width ``n_shared · d_expert`` (the same parameters and FLOPs as
    separate ones). ``capacity_factor`` limits each expert's assignments (None: no dropping);
    ``dispatch`` is ``"loop"`` or ``"sorted"`` (module docstring); ``n_devices`` groups the
    experts for the per-device balance loss.

    After every forward the layer keeps ``aux`` (unweighted ``"balance"`` (Switch),
    ``"device_balance"`` and ``"z"`` losses, scalars; computed when first read, so a forward
    whose losses nobody reads does not pay for them) and ``stats`` (``"load"``: assignments
    routed to each expert ``(E,)``; ``"kept"``: those within capacity ``(E,)``; ``"dropped"``:
    assignments over capacity; ``"tokens"``).
    """

    def __init__(self, d_model: int, d_expert: int, n_experts: int, top_k: int = 1, *,
                 router: str = "softmax_topk", n_shared: int = 0, capacity_factor: float | None = None,
                 dispatch: str = "sorted", activation: str = "swiglu", n_devices: int = 1,
                 bias_rate: float = 0.0):
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"unknown dispatch {dispatch!r}: use one of {DISPATCHES}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0, or None for no dropping")
        if n_experts % n_devices:
            raise ValueError(f"{n_experts} experts do not split over n_devices={n_devices}: "
                             f"use a divisor of {n_experts}")
        self.top_k, self.capacity_factor, self.dispatch, self.n_devices = top_k, capacity_factor, dispatch, n_devices
        self.router = Router(d_model, n_experts, top_k, router, bias_rate)
        self.experts = Experts(n_experts, d_model, d_expert, activation)
        self.shared = GatedMLP(d_model, n_shared * d_expert, activation) if n_shared else None
        self._aux: dict[str, torch.Tensor] | None = {}
        self._aux_from = None          # what the last forward's losses are computed from, until read
        self.stats: dict[str, torch.Tensor | int] = {}

    @property
    def n_experts(self) -> int:
        return self.experts.n_experts

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``token_ids`` (the ids of the tokens ``x`` stands for, any shape with ``x.shape[:-1]``
        elements) are needed by hash routing only."""
        flat = x.reshape(-1, x.shape[-1])                                        # (N, d)
        routing = self.router(flat, token_ids, self.capacity_factor)
        token, expert, weight = self.drop_over_capacity(routing, flat.shape[0])
        if self.dispatch == "loop":
            out = self.combine_loop(flat, token, expert, weight)
        else:
            out = self.combine_sorted(flat, token, expert, weight)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)

    def drop_over_capacity(self, routing: Routing, N: int):
        """Apply the capacity, record the statistics (and what the losses of :attr:`aux` are computed
        from); return the kept ``(token, expert, weight)`` assignments."""
        E = self.n_experts
        token, expert, weight = routing.token, routing.expert, routing.weight
        load = bin_counts(expert, E) if routing.load is None else routing.load
        kept = load                                                 # unless the capacity drops some
        C = capacity(N, self.top_k, E, self.capacity_factor)
        if C is not None and self.router.kind != "expert_choice":  # expert choice is capped already
            # Rank of each assignment within its expert's queue, in assignment order.
            order = torch.argsort(expert, stable=True)
            starts = torch.cumsum(load, 0) - load
            rank = torch.empty_like(order)
            rank[order] = torch.arange(len(order), device=order.device) - starts[expert[order]]
            keep = rank < C
            token, expert, weight = token[keep], expert[keep], weight[keep]
            kept = load.clamp(max=C)                                # each expert's first C
        if self.router.kind == "expert_choice":   # "dropped": tokens no expert picked
            dropped = (bin_counts(token, N) == 0).sum()
        elif C is None:
            dropped = load.new_zeros(())
        else:
            dropped = load.sum() - kept.sum()
        # Tensors on the layer's device: reading them (int(), .tolist()) is the only host sync.
        self.stats = {"load": load, "kept": kept, "dropped": dropped, "tokens": N}
        if self.training and self.router.bias_rate:   # what update_bias reads
            self.router.load_since_update = self.router.load_since_update.to(load.device) + load

        self._aux, self._aux_from = None, (routing.probs, routing.logits, load)
        return token, expert, weight

    @property
    def aux(self) -> dict[str, torch.Tensor]:
        """The last forward's balancing losses (class docstring), computed on the first read after it."""
        if self._aux is None:
            probs, logits, load = self._aux_from
            if probs is None:                    # hash routing: no router, nothing to balance
                zero = load.new_zeros((), dtype=torch.float32)
                self._aux = {"balance": zero, "device_balance": zero, "z": zero}
            else:
                self._aux = {"balance": switch_loss(probs, load),
                             "device_balance": device_balance_loss(probs, load, self.n_devices),
                             "z": router_z_loss(logits)}
            self._aux_from = None
        return self._aux

    def combine_loop(self, x, token, expert, weight):
        """The idea: for each expert, gather its tokens, run it, add the weighted outputs back."""
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            mine = (expert == e).nonzero(as_tuple=True)[0]
            if mine.numel():
                y = self.experts.expert(e, x[token[mine]])
                out = out.index_add(0, token[mine], (y * weight[mine, None]).to(out.dtype))
        return out

    def combine_sorted(self, x, token, expert, weight):
        """The fast path: sort assignments by expert, one grouped computation, weighted scatter-add."""
        order = torch.argsort(expert, stable=True)
        group_sizes = bin_counts(expert, self.n_experts)
        rows = token[order]
        y = self.experts(x[rows], group_sizes)                                 # (A, d), sorted
        # Under autocast y may be bf16 while x (the residual stream) is float32: add in x's dtype.
        return torch.zeros_like(x).index_add(0, rows, (y * weight[order, None].to(y.dtype)).to(x.dtype))

    def update_bias(self) -> None:
        """Call after each optimizer step: the sigmoid router's bias update (:meth:`Router.update_bias`)."""
        self.router.update_bias()

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, dispatch={self.dispatch!r}"


def moe_from_config(config) -> MoE:
    """The MoE feed-forward a :class:`~lmfs.nn.TransformerConfig`'s ``moe_*`` fields describe."""
    c = config
    return MoE(c.d_model, c.moe_dim, c.moe_experts, c.moe_top_k, router=c.moe_router,
               n_shared=c.moe_shared_experts, capacity_factor=c.moe_capacity_factor,
               dispatch=c.moe_dispatch, activation=c.ffn, n_devices=c.moe_devices, bias_rate=c.moe_bias_rate)


def upcycle(dense_model, n_experts: int, top_k: int, every: int = 1, router_std: float = 1e-3, **moe_fields):
    """An MoE :class:`~lmfs.nn.TransformerLM` initialised from a trained dense one ("sparse
    upcycling", Komatsuzaki et al. 2022).

    Every weight is copied; in each MoE layer (every ``every``-th) all ``n_experts`` experts start
    as copies of that layer's dense MLP and the router as small random weights (std
    ``router_std``), so routing starts almost uniform and training breaks the symmetry.
    ``moe_fields`` set other ``moe_*`` config fields without the prefix (e.g. ``router="sigmoid"``,
    ``capacity_factor=1.25``); the default router is ``"topk_softmax"``, whose weights sum to 1,
    so the upcycled model starts computing the dense model's function for any ``top_k``.
    The dense MLPs must be gated (SwiGLU/GeGLU) and the expert width is the dense ``d_ff``.
    """
    fields = {"moe_router": "topk_softmax"} | {f"moe_{k}": v for k, v in moe_fields.items()}
    config = dataclasses.replace(dense_model.config, moe_experts=n_experts, moe_top_k=top_k, moe_every=every,
                                 moe_expert_dim=None, **fields)
    model = type(dense_model)(config).to(next(dense_model.parameters()).device)   # a TransformerLM
    dense, ours = dense_model.state_dict(), model.state_dict()
    with torch.no_grad():
        model.load_state_dict({k: v for k, v in dense.items() if k in ours}, strict=False)
        for i, block in enumerate(model.blocks):
            if not isinstance(block.mlp, MoE):
                continue
            for name, proj in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
                weight = dense[f"blocks.{i}.mlp.{proj}.weight"]          # (d_out, d_in), Linear's layout
                getattr(block.mlp.experts, name).copy_(weight.T.expand_as(getattr(block.mlp.experts, name)))
            if block.mlp.router.proj is not None:
                block.mlp.router.proj.weight.normal_(0.0, router_std)
    return model

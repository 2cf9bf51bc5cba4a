"""A decoder-only transformer language model, configurable across the design space of
GPT-2 / Llama / Gemma / OLMo / DeepSeek by one :class:`~lmfs.nn.config.TransformerConfig`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmfs.nn.attention import CausalSelfAttention
from lmfs.nn.config import TransformerConfig, layer_config
from lmfs.nn.layers import Embedding, Linear, make_ffn, make_norm
from lmfs.nn.moe import MoE, moe_from_config
from lmfs.nn.positions import make_absolute_positions


class Block(nn.Module):
    """One transformer layer: attention then MLP, each a residual branch ``x -> x + f(x)``.

    Where the norms go (``config.norm_position``), for a branch ``f``:

        pre:     x = x + f(norm(x))                 GPT-2, Llama: the residual stream stays clean
        post:    x = norm(x + f(x))                 the original Transformer, BERT
        double:  x = x + norm_out(f(norm(x)))       "sandwich", Gemma 2: also bounds each update

    With ``config.parallel`` there is one branch ``f(h) = attn(h) + mlp(h)`` instead of two in
    sequence (GPT-J, PaLM): both read the same input, which lets their matmuls run together.
    ``forward(x, positions=None)`` maps ``(B, T, d_model)`` to ``(B, T, d_model)``; ``positions``
    goes to attention (:class:`~lmfs.nn.attention.CausalSelfAttention`). Like attention, a block
    can be built from config fields alone: ``Block(d_model=64, n_heads=4, ffn="gelu")``.

    ``layer`` is the block's index in the model: with ``config.moe_experts`` it decides
    (:meth:`~lmfs.nn.TransformerConfig.is_moe_layer`) whether ``mlp`` is an
    :class:`~lmfs.nn.moe.MoE`, whose hash router needs the ``token_ids`` ``(B, T)`` of ``forward``.
    """

    def __init__(self, config: TransformerConfig | None = None, layer: int = 0, **fields):
        super().__init__()
        config = layer_config(config, fields)
        self.position = config.norm_position
        self.parallel = config.parallel
        self.attn = CausalSelfAttention(config)
        self.mlp = (moe_from_config(config) if config.is_moe_layer(layer)
                    else make_ffn(config.ffn, config.d_model, config.ffn_dim, config.bias))
        branches = 1 if config.parallel else 2
        # norms[i]: the input norm of branch i (pre, double), or the norm after its sum (post).
        self.norms = nn.ModuleList(
            make_norm(config.norm, config.d_model, config.norm_eps) for _ in range(branches))
        self.out_norms = nn.ModuleList(
            make_norm(config.norm, config.d_model, config.norm_eps) for _ in range(branches)
        ) if config.norm_position == "double" else None

    def residual(self, x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor], i: int):
        """Residual branch ``i``: ``x + f(x)`` with the norms where ``norm_position`` puts them."""
        if self.position == "post":
            return self.norms[i](x + f(x))
        y = f(self.norms[i](x))
        if self.out_norms is not None:
            y = self.out_norms[i](y)
        return x + y

    def feed_forward(self, h: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp(h, token_ids) if isinstance(self.mlp, MoE) else self.mlp(h)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel:
            return self.residual(x, lambda h: self.attn(h, positions) + self.feed_forward(h, token_ids), 0)
        x = self.residual(x, lambda h: self.attn(h, positions), 0)
        return self.residual(x, lambda h: self.feed_forward(h, token_ids), 1)


class TransformerLM(nn.Module):
    """Token ids ``(B, T)`` -> next-token logits ``(B, T, vocab_size)`` and optionally a loss.

    Layout: token embedding (+ learned or sinusoidal positions) -> ``n_layers`` :class:`Block` ->
    final norm (skipped for post-norm, whose blocks already end in one) -> output head (the
    embedding matrix itself when ``tie_embeddings``) -> optional soft-cap ``cap·tanh(z/cap)``.

    Initialisation (GPT-2 style): every linear and embedding weight is normal(0, ``init_std``),
    except the two projections that write into the residual stream (attention ``o_proj`` and
    MLP ``down``), which use ``init_std / sqrt(2·n_layers)`` so that the stream's variance does
    not grow with depth (there are ``2·n_layers`` such writes). Biases start at 0, norm gains at
    1 and LayerNorm biases at 0. MoE experts follow the same rule (their ``w_down`` writes into
    the stream).

    With MoE layers (``config.moe_experts``), the training-mode loss also carries their weighted
    balancing losses (:meth:`moe_loss`); :meth:`aux_losses` and :meth:`moe_stats` report them and
    the loads, and :meth:`update_moe_biases` is the per-step hook of the sigmoid router.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.tok_emb = Embedding(config.vocab_size, config.d_model)
        self.pos_emb = make_absolute_positions(config.positions, config.context_length, config.d_model)
        self.blocks = nn.ModuleList(Block(config, layer=i) for i in range(config.n_layers))
        self.final_norm = (make_norm(config.norm, config.d_model, config.norm_eps)
                           if config.norm_position != "post" else None)
        self.lm_head = None if config.tie_embeddings else Linear(config.d_model, config.vocab_size)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Apply the initialisation stated in the class docstring."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (Linear, Embedding)):
                module.weight.normal_(0.0, std)
            if isinstance(module, Linear) and module.bias is not None:
                module.bias.zero_()
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            block.attn.o_proj.weight.normal_(0.0, out_std)
            if isinstance(block.mlp, MoE):
                experts = block.mlp.experts
                experts.w_gate.normal_(0.0, std)
                experts.w_up.normal_(0.0, std)
                experts.w_down.normal_(0.0, out_std)
                if block.mlp.shared is not None:
                    block.mlp.shared.down.weight.normal_(0.0, out_std)
            else:
                block.mlp.down.weight.normal_(0.0, out_std)
        # Norms were built at weight 1 / bias 0 and nothing above touched them.

    def num_params(self) -> int:
        """All trainable parameters; a tied embedding is one tensor and counts once.

        Equals :func:`lmfs.nn.count_params` of the config. Buffers such as the sinusoidal
        position table are not parameters and are not counted.
        """
        return sum(p.numel() for p in self.parameters())

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forwards, in layer order (empty for a dense model)."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """The MoE layers' balancing losses of the last forward, summed over layers, unweighted."""
        layers = self.moe_layers()
        return {name: sum(moe.aux[name] for moe in layers) for name in layers[0].aux} if layers else {}

    def moe_loss(self) -> torch.Tensor | float:
        """What the last forward's MoE layers add to the loss: ``moe_aux_loss · Switch +
        moe_device_loss · per-device + moe_z_loss · z``, summed over layers (0 for a dense model)."""
        c, aux = self.config, self.aux_losses()
        if not aux:
            return 0.0
        return c.moe_aux_loss * aux["balance"] + c.moe_device_loss * aux["device_balance"] + c.moe_z_loss * aux["z"]

    def moe_stats(self) -> list[dict]:
        """Per MoE layer, its load statistics of the last forward (:class:`~lmfs.nn.moe.MoE`)."""
        return [moe.stats for moe in self.moe_layers()]

    def update_moe_biases(self) -> None:
        """Call after each optimizer step: every sigmoid router's loss-free bias update."""
        for moe in self.moe_layers():
            moe.update_bias()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """Return ``(logits, loss)``; ``loss`` is ``None`` without ``targets``.

        ``idx`` and ``targets`` are integer ``(B, T)`` with ``T <= context_length``. The loss is the
        mean cross-entropy over targets that are not ``-100`` (the ignore index), plus
        ``z_loss · mean(logsumexp(logits)²)`` when ``config.z_loss > 0``, which keeps the softmax
        normaliser near 1 and the logits from drifting (PaLM). ``positions`` (integer ``(T,)`` or
        ``(B, T)``, default ``0 .. T-1``) says where each token sits: an offset for a sequence
        that continues an earlier one, a restart at 0 for each document packed into a row.
        In training mode an MoE model's loss also has :meth:`moe_loss` added; in eval mode it is
        the language-modelling loss alone, comparable with a dense model's.
        """
        self._check_input(idx, targets, positions)
        logits = self.head(self.hidden(idx, positions))
        if targets is None:
            return logits, None
        loss = self.loss(logits, targets)
        return logits, loss + self.moe_loss() if self.training else loss

    def hidden(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states ``(B, T, d_model)``: embeddings, every block, the final norm."""
        x = self.tok_emb(idx)  # (B, T, d_model)
        if self.pos_emb is not None:
            x = x + self.pos_emb(idx.shape[1] if positions is None else positions)
        for block in self.blocks:
            x = block(x, positions, idx)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

    def head_weight(self) -> torch.Tensor:
        """The output matrix ``(vocab_size, d_model)``: the token embedding's when tied."""
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(B, T, d_model)`` -> logits ``(B, T, vocab_size)``, soft-capped if configured."""
        logits = x @ self.tok_emb.weight.T if self.lm_head is None else self.lm_head(x)
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` targets, plus the z-loss.

        ``F.cross_entropy`` computes what :func:`lmfs.nn.functional.cross_entropy` writes out, and
        keeps less for the backward pass (the log-softmax only)."""
        flat, flat_targets = logits.flatten(0, 1).float(), targets.flatten()
        loss = F.cross_entropy(flat, flat_targets, ignore_index=-100)
        if self.config.z_loss > 0:
            keep = flat_targets != -100
            log_z = torch.logsumexp(flat[keep], dim=-1)
            loss = loss + self.config.z_loss * log_z.pow(2).mean()
        return loss

    def _check_input(self, idx: torch.Tensor, targets: torch.Tensor | None, positions: torch.Tensor | None = None):
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time) token ids, got shape {tuple(idx.shape)}; "
                             "for a single sequence pass idx[None]")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}; use idx.long()")
        T, ctx = idx.shape[1], self.config.context_length
        if T > ctx:
            raise ValueError(f"sequence length {T} exceeds context_length={ctx}: crop the input "
                             f"(idx[:, -{ctx}:]) or build the model with a larger context_length")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets must have the same shape as idx {tuple(idx.shape)}, got "
                             f"{tuple(targets.shape)}; targets are idx shifted left by one token")
        if positions is not None and (positions.shape not in (idx.shape[1:], idx.shape)
                                      or positions.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"positions must be integer ({idx.shape[1]},) or {tuple(idx.shape)} like idx, got "
                             f"{positions.dtype} {tuple(positions.shape)}; e.g. torch.arange(T) + offset")

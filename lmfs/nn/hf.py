"""Convert between :class:`~lmfs.nn.TransformerLM` and Hugging Face ``LlamaForCausalLM``.

Only the Llama-shaped corner of :class:`~lmfs.nn.TransformerConfig` converts: RMSNorm, pre-norm,
sequential (not parallel) blocks, SwiGLU, RoPE, MHA/GQA/MQA, no biases, no QK-norm, no soft-caps,
no sliding window; tied or untied embeddings. Both libraries pair RoPE dimensions the same way
(dim ``i`` with ``i + head_dim/2``, see :mod:`lmfs.nn.positions`), so every tensor copies over
unchanged, without the q/k permutation an interleaved-RoPE model would need.

Needs ``transformers >= 5`` (it reads ``config.rope_parameters``); it is imported only when a
function here is called.
"""

from __future__ import annotations

from lmfs.nn.config import TransformerConfig
from lmfs.nn.transformer import TransformerLM


def llama_incompatibilities(config: TransformerConfig) -> list[str]:
    """The settings of ``config`` that a Llama checkpoint cannot express (empty if none)."""
    required = {"norm": "rms", "norm_position": "pre", "parallel": False, "ffn": "swiglu",
                "positions": "rope", "attention": "mha", "bias": False, "qk_norm": False,
                "logit_softcap": None, "attn_softcap": None, "window": None}
    return [f"{name}={getattr(config, name)!r} (Llama needs {want!r})"
            for name, want in required.items() if getattr(config, name) != want]


def _key_pairs(n_layers: int) -> list[tuple[str, str]]:
    """``(lmfs name, Hugging Face name)`` for every tensor except the output head."""
    pairs = [("tok_emb.weight", "model.embed_tokens.weight")]
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            pairs.append((f"{ours}attn.{proj}.weight", f"{theirs}self_attn.{proj}.weight"))
        for proj in ("gate", "up", "down"):
            pairs.append((f"{ours}mlp.{proj}.weight", f"{theirs}mlp.{proj}_proj.weight"))
        pairs.append((f"{ours}norms.0.weight", f"{theirs}input_layernorm.weight"))
        pairs.append((f"{ours}norms.1.weight", f"{theirs}post_attention_layernorm.weight"))
    pairs.append(("final_norm.weight", "model.norm.weight"))
    return pairs


def to_hf_llama(model: TransformerLM):
    """``(state_dict, LlamaConfig)`` for ``LlamaForCausalLM``; load with ``load_state_dict``.

    Raises ``ValueError`` listing every setting outside the Llama subset. With tied embeddings
    the state dict still carries ``lm_head.weight`` (a copy of the embedding), as Hugging Face's
    own state dicts do, and the config says ``tie_word_embeddings=True``.
    """
    from transformers import LlamaConfig

    c = model.config
    problems = llama_incompatibilities(c)
    if problems:
        raise ValueError("this model cannot be exported as Llama; change: " + "; ".join(problems))
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.kv_heads, head_dim=c.head_dim, hidden_act="silu",
        max_position_embeddings=c.context_length, rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False,
        initializer_range=c.init_std,
    )
    ours = model.state_dict()
    state = {theirs: ours[mine].detach().clone() for mine, theirs in _key_pairs(c.n_layers)}
    head = "tok_emb.weight" if c.tie_embeddings else "lm_head.weight"
    state["lm_head.weight"] = ours[head].detach().clone()
    return state, hf_config


def _hf_incompatibilities(hf_config) -> list[str]:
    """The settings of a Hugging Face Llama config that :class:`TransformerLM` cannot express."""
    problems = []
    if hf_config.hidden_act != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} (only 'silu', i.e. SwiGLU)")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        problems.append("attention_bias / mlp_bias (lmfs's Llama subset has no biases)")
    rope_type = (hf_config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (only plain RoPE; no llama3/yarn/linear scaling)")
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim * hf_config.num_attention_heads != hf_config.hidden_size:
        problems.append(f"head_dim={head_dim} != hidden_size / num_attention_heads")
    return problems


def from_hf_llama(hf_model_or_state_dict, hf_config=None) -> TransformerLM:
    """A :class:`TransformerLM` with the weights of a Hugging Face Llama model or state dict.

    ``hf_config`` (a ``LlamaConfig``) may be left out when a model is passed: its ``.config`` is
    used. Raises ``ValueError`` listing the config's settings outside the supported subset.
    """
    if isinstance(hf_model_or_state_dict, dict):
        state = hf_model_or_state_dict
        if hf_config is None:
            raise ValueError("from_hf_llama got a state dict without its config: pass hf_config "
                             "(the LlamaConfig the weights belong to)")
    else:
        state = hf_model_or_state_dict.state_dict()
        hf_config = hf_config if hf_config is not None else hf_model_or_state_dict.config
    problems = _hf_incompatibilities(hf_config)
    if problems:
        raise ValueError("this Llama config is outside what lmfs.nn supports: " + "; ".join(problems))

    config = TransformerConfig(
        vocab_size=hf_config.vocab_size, context_length=hf_config.max_position_embeddings,
        d_model=hf_config.hidden_size, n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads, n_kv_heads=hf_config.num_key_value_heads,
        d_ff=hf_config.intermediate_size, norm="rms", norm_eps=hf_config.rms_norm_eps,
        norm_position="pre", ffn="swiglu", positions="rope",
        rope_theta=hf_config.rope_parameters["rope_theta"], init_std=hf_config.initializer_range,
        tie_embeddings=hf_config.tie_word_embeddings, bias=False,
    )
    model = TransformerLM(config)
    ours = {mine: state[theirs] for mine, theirs in _key_pairs(config.n_layers)}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = state["lm_head.weight"]
    model.load_state_dict(ours, strict=True)  # copies, casting to the model's float32
    return model

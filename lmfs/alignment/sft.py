"""Supervised fine-tuning (SFT): imitate good responses, learning only from the response tokens.

The pipeline, for one ``(instruction, response)`` example::

    chat template   "<|user|>\\nWhat is 2 + 3?<|end|>\\n<|assistant|>\\n" + "2 + 3 = 5.\\nAnswer: 5" + "<|end|>"
    token ids       [u, ..prompt.., a, \\n, ..response.., e]
    loss mask       [0,  0 ... 0,   0, 0,   1 ... 1,    1]     True on the response and its <|end|>

The prompt is context, not something to imitate: its tokens carry no loss. Examples are then
*packed* several to a row of ``context_length`` tokens (:func:`pack`), so short examples do not
waste the batch on padding; each example restarts its positions at 0. (Attention is only causal,
so an example can still look at the ones before it in its row; they are unrelated and end in
``<|end|>``, which the model learns to treat as a boundary.)

:func:`response_logprobs` gives the log-probability and the entropy of every response token,
the quantities DPO and the policy-gradient lectures are built on. :func:`train_sft` runs AdamW
over micro-batches with gradient accumulation, weighting each micro-batch by its number of
response tokens so that the accumulated gradient is exactly that of the whole batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lmfs.data.corpora import EOT
from lmfs.optim import clip_grad_norm
from lmfs.train import History, TrainConfig, make_optimizer, resolve_autocast

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (EOT, USER, ASSISTANT, END)   # every tokenizer of the alignment lectures has these
CHAT_TEMPLATE = USER + "\n{instruction}" + END + "\n" + ASSISTANT + "\n"
IGNORE = -100                                  # the label of a token that carries no loss


def format_prompt(instruction: str) -> str:
    """The chat template around one user turn, ending where the assistant's reply begins.

    >>> format_prompt("What is 2 + 3?")
    '<|user|>\\nWhat is 2 + 3?<|end|>\\n<|assistant|>\\n'
    """
    return CHAT_TEMPLATE.format(instruction=instruction)


def end_id(tokenizer) -> int:
    """The id of ``<|end|>``, which closes every turn (generation stops at it)."""
    if END not in getattr(tokenizer, "special_ids", {}):
        raise ValueError(f"the tokenizer has no {END} token: build it with the special tokens "
                         f"lmfs.alignment.sft.SPECIAL_TOKENS (lmfs.alignment.base.base_model does)")
    return tokenizer.special_ids[END]


def padding_id(tokenizer) -> int:
    """The id that pads batches of token rows: ``<|endoftext|>``, which separates documents. A padded
    position carries no loss, but a model still reads it, so padding uses a token the model knows as
    a boundary rather than whatever id 0 happens to be in the vocabulary."""
    if EOT not in getattr(tokenizer, "special_ids", {}):
        raise ValueError(f"the tokenizer has no {EOT} token to pad with: build it with the special tokens "
                         f"lmfs.alignment.sft.SPECIAL_TOKENS (lmfs.alignment.base.base_model does)")
    return tokenizer.special_ids[EOT]


def encode_example(tokenizer, prompt: str, response: str,
                   context_length: int | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of one example and its loss mask: True on the response tokens and the final ``<|end|>``.

    ``prompt`` is the user's instruction (wrapped here in :func:`format_prompt`; a prompt that
    already starts with ``<|user|>`` is taken as formatted). Prompt and response are encoded
    separately: at generation time the prompt's tokens are fixed and the response is produced
    after them, so training must cut the text at the same place (BPE on the joined text could merge
    across the seam). Raises ``ValueError`` for an empty response, and for an example longer than
    ``context_length`` when one is given.
    """
    if not response:
        raise ValueError(f"the response to {prompt[:40]!r} is empty: every example needs a response to "
                         "learn from (drop the example, or write the reply)")
    text = prompt if prompt.startswith(USER) else format_prompt(prompt)
    prompt_ids, response_ids = tokenizer.encode(text), tokenizer.encode(response) + [end_id(tokenizer)]
    ids = prompt_ids + response_ids
    if context_length is not None and len(ids) > context_length:
        raise ValueError(f"the example {prompt[:40]!r} has {len(ids)} tokens ({len(prompt_ids)} of prompt), more "
                         f"than context_length={context_length}: shorten or drop it, or use a model with a "
                         "longer context")
    return ids, [False] * len(prompt_ids) + [True] * len(response_ids)


def pack(encoded: Sequence[tuple[list[int], list[bool]]], context_length: int, pad_id: int = 0) -> dict:
    """Pack encoded examples into rows of ``context_length`` tokens, first fit in the given order.

    Returns a dict of ``(B, T)`` tensors (``T = context_length``): ``input_ids``; ``labels``, where
    ``labels[b, t]`` is the token that follows position ``t`` when it is a response token of the
    same example and ``-100`` (ignored) otherwise; ``positions``, restarting at 0 for each example;
    and ``mask``, the loss mask of each token itself (True on response tokens). Padding is
    ``pad_id``, labelled -100. An example longer than ``context_length`` raises ``ValueError``.
    """
    rows: list[list[tuple[list[int], list[bool]]]] = []
    used: list[int] = []
    for i, (ids, mask) in enumerate(encoded):
        if len(ids) != len(mask):
            raise ValueError(f"example {i}: {len(ids)} ids but {len(mask)} mask entries; use encode_example")
        if len(ids) > context_length:
            raise ValueError(f"example {i} has {len(ids)} tokens, more than context_length={context_length}: "
                             "drop it, shorten its prompt, or pack to a longer context")
        # First fit: the first row with room (rows fill up in order, so few stay half empty).
        for r, n in enumerate(used):
            if n + len(ids) <= context_length:
                rows[r].append((ids, mask))
                used[r] += len(ids)
                break
        else:
            rows.append([(ids, mask)])
            used.append(len(ids))
    if not rows:
        raise ValueError("nothing to pack: give at least one encoded example")

    B, T = len(rows), context_length
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    for b, row in enumerate(rows):
        t = 0
        for ids, mask in row:
            n = len(ids)
            ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
            input_ids[b, t:t + n] = ids_t
            positions[b, t:t + n] = torch.arange(n)
            loss_mask[b, t:t + n] = mask_t
            # Position t predicts token t + 1: a label wherever that next token is a response token.
            labels[b, t:t + n - 1] = torch.where(mask_t[1:], ids_t[1:], IGNORE)
            t += n
    return dict(input_ids=input_ids, labels=labels, positions=positions, mask=loss_mask)


def pad_batch(encoded: Sequence[tuple[list[int], list[bool]]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One example per row, right-padded to the longest: ``input_ids`` ``(B, T)`` and the loss
    ``mask`` ``(B, T)`` (False on padding). For scoring whole responses (reward model, DPO)."""
    T = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), T), dtype=torch.bool)
    for b, (ids, m) in enumerate(encoded):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        mask[b, :len(m)] = torch.tensor(m)
    return input_ids, mask


def response_logprobs(model, input_ids: torch.Tensor, mask: torch.Tensor,
                      positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probability and entropy of the response tokens.

    ``input_ids`` ``(B, T)``; ``mask`` ``(B, T)`` True on response tokens (as from
    :func:`encode_example`), or ``(B, T-1)`` already aligned with the predictions. Returns
    ``logp`` and ``entropy``, both float32 ``(B, T-1)``: entry ``t`` is about token ``t + 1``
    predicted from tokens ``0..t``, ``logp = log p(x_{t+1} | x_{<=t})`` and the entropy
    ``-sum_v p(v) log p(v)`` of that prediction; both are 0 where the token is not a response token.
    Gradients flow through both (the caller decides with ``torch.no_grad()``).
    """
    if mask.shape == input_ids.shape:
        mask = mask[:, 1:]
    if mask.shape != (input_ids.shape[0], input_ids.shape[1] - 1):
        raise ValueError(f"mask must be (B, T) like input_ids {tuple(input_ids.shape)} or (B, T-1), "
                         f"got {tuple(mask.shape)}")
    logits = model(input_ids[:, :-1], positions=None if positions is None else positions[..., :-1])[0]
    logp, entropy = token_logprobs(logits, input_ids[:, 1:])
    mask = mask.to(logp.device)
    return logp * mask, entropy * mask


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` of ``(..., V)`` logits, float32 ``(...)``: the log-probability of each
    ``targets`` id and the entropy ``-sum_v p(v) log p(v)`` of its distribution. Logits of ``-inf``
    (a top-k mask, a padded vocabulary) have probability 0 and add 0 to the entropy, not NaN
    (``0 * log 0`` is taken as its limit, 0), with finite gradients."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logp = logprobs.gather(-1, targets[..., None]).squeeze(-1)
    # exp(-inf) * -inf is NaN; clamped to the lowest float, the product is 0 and its gradient finite
    entropy = -(logprobs.exp() * logprobs.clamp(min=torch.finfo(logprobs.dtype).min)).sum(-1)
    return logp, entropy


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The summed cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` labels where the label
    is not -100, and the number of such tokens. Positions labelled -100 contribute nothing, not
    even a gradient."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return total, int((labels != IGNORE).sum())


def sft_loss(model, batch: dict, normalizer: int | None = None) -> torch.Tensor:
    """Mean cross-entropy over the response tokens of a packed ``batch`` (from :func:`pack`).

    ``normalizer`` divides the summed loss instead of this batch's own token count: pass the
    token count of the whole batch when ``batch`` is one micro-batch of it, so the micro-batches'
    losses add up to the whole batch's mean.
    """
    device = next(model.parameters()).device
    positions = batch.get("positions")
    logits = model(batch["input_ids"].to(device), positions=None if positions is None else positions.to(device))[0]
    total, count = token_losses(logits, batch["labels"].to(device))
    if count == 0:
        raise ValueError("the batch has no response tokens to learn from: check the loss masks")
    return total / (normalizer or count)


def accumulate_sft_gradients(model, batch: dict, micro_batch_size: int,
                             autocast_dtype: torch.dtype | None = None) -> float:
    """Backward the batch's mean response-token loss in micro-batches of ``micro_batch_size`` rows;
    return that loss.

    Rows hold different numbers of response tokens, so the mean of the micro-batches' means is
    *not* the batch's mean. Each micro-batch's summed loss is divided by the token count of the
    whole batch instead: the gradients then add up to exactly the full batch's gradient.
    Gradients are added to ``.grad``: zero them before a new step.
    """
    device = next(model.parameters()).device
    n_tokens = int((batch["labels"] != IGNORE).sum())
    if n_tokens == 0:
        raise ValueError("the batch has no response tokens to learn from: check the loss masks")
    total = 0.0
    for start in range(0, batch["input_ids"].shape[0], micro_batch_size):
        micro = {k: v[start:start + micro_batch_size] for k, v in batch.items()}
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = sft_loss(model, micro, normalizer=n_tokens)
        loss.backward()
        total += loss.item()
    return total


def shuffled_batches(n: int, batch_size: int, steps: int, generator: torch.Generator):
    """Yield ``steps`` index tensors of ``batch_size`` items each, taken in order from shuffled passes
    over ``range(n)`` (a new shuffle whenever a pass is used up, so every item is seen once per pass)."""
    order, cursor = torch.randperm(n, generator=generator), 0
    for _ in range(steps):
        take = []
        while sum(len(t) for t in take) < batch_size:
            if cursor == n:
                order, cursor = torch.randperm(n, generator=generator), 0
            k = min(batch_size - sum(len(t) for t in take), n - cursor)
            take.append(order[cursor:cursor + k])
            cursor += k
        yield torch.cat(take)


def make_run(model, steps: int, batch_size: int, lr: float, *, context_length: int, warmup_steps: int = 0,
             weight_decay: float = 0.0, grad_clip: float | None = 1.0, seed: int = 0,
             autocast: str = "auto") -> tuple[TrainConfig, torch.optim.Optimizer, torch.dtype | None]:
    """What the alignment trainers share with :func:`lmfs.train.train`: a :class:`TrainConfig` (for
    its validated settings and cosine schedule), AdamW with its weight-decay groups, and the
    autocast dtype (bf16 on CUDA, none on the CPU)."""
    config = TrainConfig(steps=steps, batch_size=batch_size, context_length=context_length, lr=lr,
                         warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip, seed=seed,
                         autocast=autocast)
    device = next(model.parameters()).device
    return config, make_optimizer(model, config), resolve_autocast(autocast, device)


def optimizer_step(model, optimizer: torch.optim.Optimizer, config: TrainConfig, step: int, loss: float) -> float:
    """Update ``step`` (0-based) after the backward pass: refuse a non-finite ``loss``, set the
    scheduled learning rate, clip the gradient norm, step and zero the gradients; return the rate."""
    lr = config.lr_at(step)
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} at step {step + 1} (lr={lr:.3g}): training diverged; "
                                 f"lower the learning rate (e.g. lr={config.lr / 3:.2g})")
    for group in optimizer.param_groups:
        group["lr"] = lr
    if config.grad_clip:
        clip_grad_norm(model.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


def train_sft(model, examples: Sequence[tuple[str, str]], tokenizer, steps: int, batch_size: int,
              micro_batch_size: int | None = None, lr: float = 1e-4, *, context_length: int | None = None,
              warmup_steps: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0, seed: int = 0,
              val_examples: Sequence[tuple[str, str]] | None = None, eval_every: int = 0,
              autocast: str = "auto", progress: bool = True) -> History:
    """Fine-tune ``model`` on ``(instruction, response)`` examples; return a :class:`lmfs.train.History`.

    The examples are encoded (:func:`encode_example`; ones longer than the context are refused)
    and packed into rows of ``context_length`` (default: the model's); each step takes
    ``batch_size`` rows in a shuffled order (a new shuffle every pass) and runs them in
    micro-batches of ``micro_batch_size`` rows (:func:`accumulate_sft_gradients`), then clips and
    takes an AdamW step. The learning rate is cosine with warm-up (:class:`lmfs.train.TrainConfig`).
    ``val_examples`` are scored every ``eval_every`` steps and at the end (``History.val_loss``).
    """
    context_length = context_length or model.config.context_length
    micro_batch_size = micro_batch_size or batch_size
    pad = padding_id(tokenizer)
    packed = pack([encode_example(tokenizer, p, r, context_length) for p, r in examples], context_length, pad)
    val = (pack([encode_example(tokenizer, p, r, context_length) for p, r in val_examples], context_length, pad)
           if val_examples else None)
    config, optimizer, dtype = make_run(model, steps, batch_size, lr, context_length=context_length,
                                        warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip,
                                        seed=seed, autocast=autocast)
    rows = packed["input_ids"].shape[0]
    history, tokens = History(), 0
    if progress:
        n_resp = int((packed["labels"] != IGNORE).sum())
        print(f"SFT: {len(examples):,} examples packed into {rows:,} rows of {context_length} tokens "
              f"({n_resp:,} response tokens, {n_resp / packed['input_ids'].numel():.0%} of the slots); "
              f"{steps} steps x {batch_size} rows (micro-batches of {micro_batch_size}) = "
              f"{steps * batch_size / rows:.1f} passes")
    model.train()
    started = time.perf_counter()
    batches = shuffled_batches(rows, batch_size, steps, torch.Generator().manual_seed(seed))
    bar = tqdm(enumerate(batches), total=steps, disable=not progress, desc="sft")
    for step, index in bar:
        batch = {k: v[index] for k, v in packed.items()}
        loss = accumulate_sft_gradients(model, batch, micro_batch_size, dtype)
        lr_now = optimizer_step(model, optimizer, config, step, loss)
        tokens += int((batch["labels"] != IGNORE).sum())
        history.step.append(step + 1)
        history.loss.append(loss)
        history.lr.append(lr_now)
        history.tokens.append(tokens)
        history.seconds.append(time.perf_counter() - started)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if val is not None and (step + 1 == steps or (eval_every and (step + 1) % eval_every == 0)):
            history.val_step.append(step + 1)
            history.val_loss.append(sft_eval_loss(model, val, micro_batch_size, dtype))
    bar.close()
    model.eval()
    return history


@torch.no_grad()
def sft_eval_loss(model, packed: dict, micro_batch_size: int = 32, autocast_dtype: torch.dtype | None = None) -> float:
    """Mean response-token loss of a packed set, in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, packed["input_ids"].shape[0], micro_batch_size):
        micro = {k: v[start:start + micro_batch_size].to(device) for k, v in packed.items()}
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(micro["input_ids"], positions=micro["positions"])[0]
        s, n = token_losses(logits, micro["labels"])
        total, count = total + s.item(), count + n
    model.train(was_training)
    return total / max(count, 1)


def generate_responses(model, tokenizer, instructions: Sequence[str], max_tokens: int = 32,
                       temperature: float = 0.0, seed: int | None = None, n: int = 1) -> list[str]:
    """The model's replies to ``instructions`` in the chat template, through :class:`lmfs.inference.LLM`.

    Generation stops at ``<|end|>`` (removed from the text) or after ``max_tokens``; ``temperature``
    0 is greedy. With ``n > 1`` each instruction is answered ``n`` times (consecutive entries),
    each sample with its own seed derived from ``seed``.
    """
    from lmfs.inference import LLM, SamplingParams

    stop = (end_id(tokenizer),)
    prompts = [format_prompt(i) for i in instructions for _ in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, stop_token_ids=stop,
                             seed=None if seed is None else seed + k, logprobs=False) for k in range(len(prompts))]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        outputs = LLM(model, tokenizer, max_batch_size=min(len(prompts), 256), progress=False).generate(prompts, params)
    model.train(was_training)
    for out in outputs:
        if out.error:
            raise ValueError(f"generation failed for prompt {out.index}: {out.error}")
    return [out.text.removesuffix(END) for out in outputs]

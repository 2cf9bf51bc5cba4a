"""TRL's ``GRPOTrainer`` on the GRPO benchmark's model, task and batch (:mod:`lmfs.benchmarks.grpo`)."""

from __future__ import annotations

import tempfile
import time

import torch


def run_trl(model, tok, problems, sizes, device: torch.device) -> dict:
    """Time ``sizes.steps`` steps of TRL's GRPOTrainer on the same weights, task and batch
    (:class:`lmfs.benchmarks.grpo.Sizes`), after one warm-up step."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from lmfs.alignment.sft import END, format_prompt
    from lmfs.alignment.tasks import check_answer
    from lmfs.nn import to_hf_llama
    from lmfs.tokenization.hf import hf_tokenizer

    state, hf_config = to_hf_llama(model)
    hf_model = LlamaForCausalLM(hf_config).to(device)
    hf_model.load_state_dict(state)
    hf_tok = hf_tokenizer(tok)
    hf_tok.eos_token, hf_tok.pad_token = END, next(iter(tok.special_ids))   # stop at <|end|>, like lmfs
    hf_model.generation_config.eos_token_id = hf_tok.eos_token_id
    hf_model.generation_config.pad_token_id = hf_tok.pad_token_id
    by_prompt = {format_prompt(p.prompt): p for p in problems}
    data = Dataset.from_list([{"prompt": prompt} for prompt in by_prompt])

    def reward(prompts, completions, **_):
        return [check_answer(by_prompt[p], c.removesuffix(END)) for p, c in zip(prompts, completions)]

    stamps, lengths = [], []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())

    batch = sizes.prompts * sizes.group_size
    with tempfile.TemporaryDirectory() as out:
        args = TRLConfig(output_dir=out, per_device_train_batch_size=sizes.micro_batch,
                         gradient_accumulation_steps=batch // sizes.micro_batch, num_generations=sizes.group_size,
                         max_completion_length=sizes.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                         learning_rate=1e-6, beta=0.0, loss_type="grpo", max_steps=sizes.steps + 1,
                         logging_steps=1, report_to="none", save_strategy="no", use_cpu=device.type != "cuda",
                         bf16=device.type == "cuda", disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = TRLTrainer(model=hf_model, reward_funcs=reward, args=args, train_dataset=data,
                             processing_class=hf_tok, callbacks=[Stamp()])
        trainer.remove_callback(PrinterCallback)       # the log of every step (kept for the lengths)
        trainer.train()
        for record in trainer.state.log_history:
            if "completions/mean_length" in record:
                lengths.append(record["completions/mean_length"])
    total = stamps[-1] - stamps[0]                      # the first step is the warm-up
    return dict(samples_per_s=batch * sizes.steps / total, seconds_per_step=total / sizes.steps,
                response_length=sum(lengths[1:]) / max(len(lengths[1:]), 1) if lengths else None)

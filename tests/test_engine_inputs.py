"""Bad input to the engine gets a clear error naming what is wrong, never silent garbage."""

import math

import numpy as np
import pytest
import torch

from lmfs.eval.harness import GenItem, evaluate_generation, generate
from lmfs.inference import LLM, RequestFailed, SamplingParams
from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.tokenization import Tokenizer


def byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [])


def tiny():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, context_length=64)
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1.0"),
    ("repetition_penalty", math.nan), ("top_p", math.nan), ("min_p", math.nan),
    ("max_tokens", True), ("max_tokens", 4.0), ("max_tokens", "4"), ("top_k", 2.0), ("top_k", True),
    ("stop_token_ids", ("5",)), ("stop_token_ids", (2.5,)), ("seed", 1.5), ("logprobs", 1),
])
def test_sampling_params_refuse_values_that_are_not_numbers_of_their_kind(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_take_integer_scalars_of_numpy_and_torch():
    sp = SamplingParams(max_tokens=np.int64(3), top_k=torch.tensor(5), stop_token_ids=[np.int32(7), 8], seed=np.int64(1))
    assert sp.stop_token_ids == (7, 8) and all(type(t) is int for t in sp.stop_token_ids)


def test_prompts_of_floats_or_strings_are_refused_naming_the_value():
    llm = LLM(tiny(), progress=False)
    for bad in ([[1.0, 2.0]], [[1, "2"]]):
        with pytest.raises(TypeError, match="token ids must be integers"):
            llm.generate(bad, SamplingParams(max_tokens=2, temperature=0))
    ok = llm.generate([np.array([1, 2, 3]), torch.tensor([4, 5])], SamplingParams(max_tokens=2, temperature=0))
    assert [len(o.token_ids) for o in ok] == [2, 2]


def test_sampling_params_given_as_a_dict_say_how_to_build_them():
    llm = LLM(tiny(), progress=False)
    with pytest.raises(TypeError, match=r"SamplingParams\(\*\*params\)"):
        llm.generate([[1, 2]], {"max_tokens": 2})
    with pytest.raises(TypeError, match=r"SamplingParams\(\*\*params\)"):
        llm.generate([[1, 2]], [{"max_tokens": 2}])


def test_stop_strings_without_a_tokenizer_are_refused():
    llm = LLM(tiny(), progress=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop=["\n"]))


def test_the_text_of_a_failed_request_raises_with_its_reason():
    llm = LLM(tiny(), byte_tokenizer(), progress=False)
    ok, failed = llm.generate([[1, 2], []], SamplingParams(max_tokens=2, temperature=0))
    assert failed.finish_reason == "error" and "empty prompt" in failed.error and failed.token_ids == []
    with pytest.raises(RequestFailed, match="request 1 failed.*empty prompt"):
        failed.text
    assert ok.finish_reason == "length" and isinstance(ok.text, str)


def test_zero_completions_per_prompt_is_refused():
    tok, model = byte_tokenizer(), tiny()
    with pytest.raises(ValueError, match="n=0"):
        generate(model, tok, ["the cat"], max_tokens=2, n=0)
    with pytest.raises(ValueError, match="n=0"):
        evaluate_generation(model, tok, [GenItem("1 + 1 =", "2")], n=0)

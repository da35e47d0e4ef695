"""``LLM`` keeps ``max_seq_len`` within the model's ``max_position_embeddings``."""

import dataclasses

import pytest

from tensorrt_llm import LLM
from tensorrt_llm._torch.models.modeling_llama import MODEL_PRESETS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHORT = dataclasses.replace(MODEL_PRESETS["tiny-random"], max_position_embeddings=64)


def test_the_default_max_seq_len_is_lowered_to_the_models_positions():
    with LLM(SHORT, max_num_tokens=32) as llm:
        assert llm.config.max_seq_len == 64
        with pytest.raises(ValueError, match="max_seq_len 64"):
            llm.generate(list(range(1, 60)))  # 59 prompt + 32 new tokens would pass position 64


def test_asking_for_more_than_the_model_has_is_an_error():
    with pytest.raises(ValueError, match=r"max_seq_len=128 exceeds the model's max_position_embeddings \(64\)"):
        LLM(SHORT, max_seq_len=128)
    with LLM(SHORT, max_seq_len=64, max_num_tokens=32) as llm:  # exactly the limit is fine
        assert llm.config.max_seq_len == 64

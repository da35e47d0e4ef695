"""Structured output with SmolLM2: random JSON schemas (hypothesis), every output parses and validates.

The LLM runs the overlap scheduler (``disable_overlap_scheduler=False``), so the guided requests'
rule is exercised: their next token is not the engine's greedy pick (the mask changes it), so a
forward that samples one completes before the next iteration is scheduled (the mask of step n+1
needs the token of step n). An unguided greedy request rides in the same batches and must give
exactly what it gives alone: a guided neighbour changes nothing for it.

``ci`` runs 3 examples of 8 schemas (24); ``thorough`` 25 examples (200 schemas).
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import validate

from benchmarks.serving.json_schemas import max_output_bytes, random_schema, schema_prompt
from tensorrt_llm.llmapi import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from tests.helpers.decisive import assert_decisive

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SCHEMAS_PER_EXAMPLE = 8
NEIGHBOUR = "Count from one to ten:"
MAX_SEQ_LEN = 1024


@pytest.fixture(scope="module")
def guided_llm():
    llm = LLM("smollm2-135m-instruct", max_seq_len=MAX_SEQ_LEN, max_num_tokens=1024, max_batch_size=16,
              disable_overlap_scheduler=False, kv_cache_config=KvCacheConfig(tokens_per_block=16, num_blocks=256))
    assert llm.executor.overlap
    alone = llm.generate(NEIGHBOUR, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)).outputs[0]
    assert_decisive(alone, "the neighbour is compared with itself in batches of other shapes")
    yield llm, alone.token_ids
    llm.shutdown()


def chat_ids(llm: LLM, messages) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def fitting_schema(llm: LLM, rng) -> tuple[dict, list[int]]:
    """A random schema, and its prompt, whose prompt and longest valid document fit ``MAX_SEQ_LEN``.
    A request that could not (prompt + max_tokens > max_seq_len) is refused when it is submitted, by
    design and tested with the executor's validation, so such a schema is drawn again."""
    for _ in range(50):
        schema = random_schema(rng)
        prompt = chat_ids(llm, schema_prompt(schema))
        if len(prompt) + max_output_bytes(schema) + 1 <= MAX_SEQ_LEN:
            return schema, prompt
    raise AssertionError(f"random_schema drew 50 schemas too long for max_seq_len {MAX_SEQ_LEN}")


@settings(max_examples=25 if THOROUGH else 3)
@given(rng=st.randoms(use_true_random=False), temperature=st.sampled_from([0.0, 0.8]))
def test_property_every_guided_output_parses_and_validates(guided_llm, rng, temperature):
    llm, alone = guided_llm
    drawn = [fitting_schema(llm, rng) for _ in range(SCHEMAS_PER_EXAMPLE)]
    schemas = [schema for schema, _ in drawn]
    handles = [
        llm.generate_async(prompt, SamplingParams(
            max_tokens=max_output_bytes(schema) + 1, temperature=temperature, seed=index,
            guided_decoding=GuidedDecodingParams(json=schema)))
        for index, (schema, prompt) in enumerate(drawn)
    ]
    neighbour = llm.generate_async(NEIGHBOUR, SamplingParams(max_tokens=12, ignore_eos=True))
    for schema, handle in zip(schemas, handles):
        output = handle.result(timeout=300).outputs[0]
        where = f"schema {json.dumps(schema)}\noutput {output.text!r}"
        assert output.finish_reason == "stop", where  # ended by the grammar's end token, not by max_tokens
        validate(json.loads(output.text), schema)
    assert neighbour.result(timeout=300).outputs[0].token_ids == alone


def test_a_bad_schema_is_refused_before_queueing_and_a_grammar_dead_end_fails_alone(guided_llm):
    llm, alone = guided_llm
    with pytest.raises(ValueError, match="guided_decoding.json"):
        llm.generate_async("hi", SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "objectx"})))
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(json={}, regex="a")
    # A regex the model must follow token by token, with a max_tokens too short to finish it:
    # the output is a prefix of a match, cut by length (as every engine cuts it).
    cut = llm.generate("Spell it:", SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(regex="[a-z]{40}")))
    assert cut.outputs[0].finish_reason == "length" and cut.outputs[0].text.isalpha()
    regex = llm.generate("Give a date:", SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(
        regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")))
    text = regex.outputs[0].text
    assert regex.outputs[0].finish_reason == "stop" and len(text) == 10 and text[:2] == "20" and text[4] == "-"
    grammar = 'start: "yes" | "no"'
    answer = llm.generate("Is the sky blue?", SamplingParams(max_tokens=5, guided_decoding=GuidedDecodingParams(grammar=grammar)))
    assert answer.outputs[0].text in ("yes", "no")
    assert llm.generate(NEIGHBOUR, SamplingParams(max_tokens=12, ignore_eos=True)).outputs[0].token_ids == alone

"""``stop_rule.finish``: the one rule for when a request is over, on every delivery path."""

import pytest
from tests.helpers.factories import make_request

from tensorrt_llm._torch.pyexecutor.sampling.stop_rule import finish


@pytest.mark.parametrize(
    "tokens, length, stops, expected",
    [
        ([7], 4, {}, (1, False)),  # prompt 4 + 1 of 3 new tokens
        ([7], 6, {}, (1, True)),  # the third new token reaches max_total_len (7)
        ([7, 8, 9], 5, {}, (2, True)),  # drafts accepted past the limit are dropped
        ([7, 2, 9], 4, {"end_id": 2}, (2, True)),  # end_id is kept, what follows dropped
        ([7, 8, 9], 4, {"stop_token_ids": [9]}, (3, True)),
        ([7, 8], 4, {"end_id": 2, "stop_token_ids": [5]}, (2, False)),
        ([2], 6, {"end_id": 2}, (1, True)),  # both at once: one token, finished
    ],
)
def test_finish(tokens, length, stops, expected):
    request = make_request([1, 3, 4, 5], max_new_tokens=3, **stops)
    assert finish(request, tokens, length) == expected


@pytest.mark.parametrize(
    "count, length, expected",
    [
        (20, 4, (20, False)),  # more tokens than the prebuilt answers cover, none at the limit
        (16, 4, (16, False)),
        (0, 4, (0, False)),  # nothing delivered: nothing kept, not over
        (1, 400, (1, True)),  # already past the limit (a restart recomputed more): the token still ends it
    ],
)
def test_finish_without_stop_tokens_is_the_length_rule(count, length, expected):
    request = make_request([1, 3, 4, 5], max_new_tokens=100)  # max_total_len 104
    assert finish(request, [7] * count, length) == expected

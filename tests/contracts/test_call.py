"""The messages of the rank-0 pipe survive pickling field for field, nested messages included."""

import pickle

import pytest

from talaria.contracts.call import (
    CallOutput,
    CallTimings,
    CancelCall,
    FinishReason,
    InstanceCall,
    SamplingParams,
    Usage,
)

SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, seed=3, ignore_eos=True,
                          stop_token_ids=(2, 9))
MESSAGES = [
    SAMPLING,
    InstanceCall("r1", "m", (5, 6, 7), SAMPLING, "s1", enqueue_time=2.5),
    InstanceCall("r2", "m", (1,), SamplingParams()),
    CancelCall("r1"),
    CallOutput("r1", (8,)),
    CallOutput("r1", (9,), FinishReason.LENGTH, Usage(3, 2, 1, 1), 5, CallTimings(0.1, 0.2, 0.3, 4.0, 0.7)),
    CallOutput("r2", (), FinishReason.ERROR, error="boom"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_unpickles_equal_to_what_was_sent(message):
    copy = pickle.loads(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
    assert copy == message and type(copy) is type(message)

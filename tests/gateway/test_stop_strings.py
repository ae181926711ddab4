"""StopStringMatcher: matches across delta boundaries, holds back partial matches, drops the stop."""

import pytest

from talaria.gateway.stop_strings import StopStringMatcher


def feed(stops, deltas):
    m = StopStringMatcher(tuple(stops))
    out = [m.push(d) for d in deltas]
    return out, m


def test_no_stops_is_passthrough():
    out, m = feed([], ["ab", "", "c"])
    assert out == ["ab", "", "c"] and m.flush() == "" and not m.stopped


def test_stop_inside_one_delta_cuts_before_it():
    out, m = feed(["STOP"], ["abcSTOPdef"])
    assert out == ["abc"] and m.stopped
    assert m.push("more") == "" and m.flush() == ""


def test_stop_split_across_deltas():
    out, m = feed(["</answer>"], ["42 </", "ans", "wer> trailing"])
    assert out == ["42 ", "", ""] and m.stopped


def test_stop_split_one_char_per_delta():
    out, m = feed(["xyz"], list("abxyzq"))
    assert "".join(out) == "ab" and m.stopped


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop():
    out, m = feed(["END"], ["foo E", "N", "X bar"])
    assert out == ["foo ", "", "ENX bar"] and not m.stopped


def test_holdback_flushed_at_end_of_generation():
    out, m = feed(["END"], ["text EN"])
    assert out == ["text "]
    assert m.flush() == "EN"
    assert m.flush() == ""  # flushing twice does not repeat text


def test_earliest_of_several_stops_wins():
    out, m = feed(["bbb", "cd"], ["a bbcd bbb"])
    assert out == ["a bb"] and m.stopped


def test_multiple_stops_with_shared_prefix_hold_longest_candidate():
    # "ab" could start "abc" (a stop) — held; "abx" is not a stop — released.
    out, m = feed(["abc", "x!"], ["zab", "x", "y"])
    assert out == ["z", "ab", "xy"]
    assert not m.stopped


def test_stop_at_very_start():
    out, m = feed(["\n\n"], ["\n", "\nrest"])
    assert out == ["", ""] and m.stopped


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(("",))

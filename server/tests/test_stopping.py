"""StoppingCriteria: length before EOS before stop sequences; stop sequences across token boundaries."""

from __future__ import annotations

from textgen_pb import generate_pb2
from textgen_server.sampling.stopping import StoppingCriteria

LENGTH = generate_pb2.FINISH_REASON_LENGTH
EOS = generate_pb2.FINISH_REASON_EOS_TOKEN
STOP = generate_pb2.FINISH_REASON_STOP_SEQUENCE


def criteria(max_new_tokens: int = 20, stop: list[str] | None = None, ignore_eos: bool = False) -> StoppingCriteria:
    pb = generate_pb2.StoppingCriteriaParameters(
        max_new_tokens=max_new_tokens, stop_sequences=stop or [], ignore_eos_token=ignore_eos
    )
    return StoppingCriteria.from_pb(pb, eos_token_ids={2, 5})


def run(c: StoppingCriteria, tokens: list[tuple[int, str]]) -> list[tuple[bool, int | None]]:
    return [c(token_id, text) for token_id, text in tokens]


def test_from_pb_copies_the_parameters() -> None:
    c = criteria(7, ["a", "bc"], ignore_eos=True)
    assert (c.max_new_tokens, c.stop_sequences, c.ignore_eos_token, c.current_tokens) == (7, ["a", "bc"], True, 0)
    assert c.eos_token_ids == {2, 5}


def test_length_stops_at_max_new_tokens_and_counts_tokens() -> None:
    c = criteria(3)
    assert run(c, [(10, "x"), (11, "y"), (12, "z")]) == [(False, None), (False, None), (True, LENGTH)]
    assert c.current_tokens == 3


def test_length_is_checked_before_eos() -> None:
    assert criteria(1)(2, "") == (True, LENGTH)


def test_any_eos_id_stops_unless_ignored() -> None:
    assert criteria()(5, "") == (True, EOS)
    assert criteria()(2, "") == (True, EOS)
    c = criteria(3, ignore_eos=True)
    assert run(c, [(2, ""), (5, ""), (2, "")]) == [(False, None), (False, None), (True, LENGTH)]


def test_eos_is_checked_before_stop_sequences() -> None:
    assert criteria(stop=["end"])(2, "end") == (True, EOS)


def test_stop_sequence_spanning_several_tokens() -> None:
    c = criteria(stop=["o world"])
    assert run(c, [(10, "Hel"), (11, "lo wo"), (12, "rld"), (13, "!")])[:3] == [
        (False, None),
        (False, None),
        (True, STOP),
    ]


def test_stop_sequence_longer_than_any_token_and_many_tokens_later() -> None:
    c = criteria(max_new_tokens=500, stop=["STOP HERE"])
    for _ in range(300):  # a long unrelated stream: the bounded tail must not forget the recent text
        assert c(10, "ab") == (False, None)
    assert run(c, [(10, "ST"), (11, "OP"), (12, " "), (13, "H"), (14, "ERE")])[-1] == (True, STOP)


def test_any_of_several_stop_sequences_and_only_at_the_end() -> None:
    c = criteria(stop=["foo", "bar"])
    assert c(10, "bar baz") == (False, None)  # "bar" is not at the end
    assert c(11, " ba") == (False, None)
    assert c(12, "r") == (True, STOP)


def test_stop_sequence_followed_by_one_final_newline_stops_like_tgi() -> None:
    assert criteria(stop=["</s>"])(10, "done</s>\n") == (True, STOP)
    assert criteria(stop=["</s>"])(10, "done</s>\n\n") == (False, None)


def test_regex_characters_are_literal() -> None:
    c = criteria(stop=["a.b"])
    assert c(10, "axb") == (False, None)
    assert c(11, "a.b") == (True, STOP)


def test_empty_token_text_keeps_the_tail() -> None:
    c = criteria(stop=["xy"])
    assert run(c, [(10, "x"), (11, ""), (12, "y")]) == [(False, None), (False, None), (True, STOP)]

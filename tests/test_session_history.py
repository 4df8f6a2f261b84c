"""The conversation a chat stage sees (``session_service.session.history``): replies enter as the
user heard them (the playback ledger), tool calls and their answers, the bounds, the records a
resume token carries."""

from __future__ import annotations

import pytest

from duplex.errors import BadEventError, ErrorCode
from session_service.session.history import (
    CANCELLED_NOTE,
    PENDING_NOTE,
    CallStatus,
    ChatHistory,
    HistoryPolicy,
    Role,
)

SENTENCES = [(0.0, "The first sentence."), (1400.0, " The second one is longer."), (3600.0, " A third.")]


def spoken_reply(h: ChatHistory, response_id: str = "r1") -> None:
    h.begin_reply(response_id)
    h.generated(response_id, "The first sentence. The second one is longer. A third.")
    for at, text in SENTENCES:
        h.spoken(response_id, at, text)


def assistant(h: ChatHistory) -> list[str]:
    return [m.content for m in h.messages if m.role is Role.ASSISTANT]


def test_a_completed_reply_enters_whole_and_the_user_is_answered() -> None:
    h = ChatHistory(HistoryPolicy())
    h.user("  what is the weather  ")
    assert h.awaiting_reply and h.messages[0].text == "what is the weather"
    spoken_reply(h)
    assert not h.awaiting_reply
    h.sent("r1", 5000)
    h.reply_ended("r1", completed=True)
    assert assistant(h) == ["The first sentence. The second one is longer. A third."]


def test_a_reply_cut_by_a_barge_in_keeps_the_sentences_whose_audio_went_out() -> None:
    h = ChatHistory(HistoryPolicy())
    h.user("hello")
    spoken_reply(h)
    h.sent("r1", 900)  # the cancel came during the first sentence
    h.reply_ended("r1", completed=False)
    assert assistant(h) == ["The first sentence."]
    h2 = ChatHistory(HistoryPolicy())
    spoken_reply(h2)
    h2.reply_ended("r1", completed=False)  # cancelled before any audio went out
    assert assistant(h2) == [""]


def test_a_playback_position_cuts_the_reply_even_after_it_completed() -> None:
    h = ChatHistory(HistoryPolicy())
    spoken_reply(h)
    h.sent("r1", 5000)
    h.reply_ended("r1", completed=True)
    # The client played 2 s of it, then the user talked (a truncate after the server was done).
    assert h.played("r1", 2000)
    assert assistant(h) == ["The first sentence. The second one is longer."]
    assert h.played("r1", 1400)  # the second sentence's audio had not begun at 1400 ms
    assert assistant(h) == ["The first sentence."]
    assert not h.played("nope", 10)


def test_tool_calls_are_answered_once_and_a_cancelled_reply_cancels_its_calls() -> None:
    h = ChatHistory(HistoryPolicy())
    h.user("weather in paris")
    h.begin_reply("r1")
    h.tool_call("r1", "call_1", "get_weather", '{"city": "Paris"}')
    h.reply_ended("r1", completed=True)
    assert h.pending_calls() == ["call_1"] and h.messages[-1].calls[0].result == PENDING_NOTE
    h.answer("call_1", '{"temp": 21}')
    assert h.awaiting_reply and h.messages[-1].calls[0].status is CallStatus.ANSWERED
    with pytest.raises(BadEventError) as err:
        h.answer("call_1", "again")
    assert err.value.code == ErrorCode.FUNCTION_CALL_ANSWERED
    with pytest.raises(BadEventError) as err:
        h.answer("call_x", "?")
    assert err.value.code == ErrorCode.UNKNOWN_CALL_ID
    # A reply barged into after it called a tool: the call is cancelled and says so to the model.
    h.begin_reply("r2")
    h.tool_call("r2", "call_2", "book", "{}")
    h.reply_ended("r2", completed=False)
    call = h.messages[-1].calls[0]
    assert call.status is CallStatus.CANCELLED and call.result == CANCELLED_NOTE
    with pytest.raises(BadEventError) as err:
        h.answer("call_2", "done")
    assert err.value.code == ErrorCode.FUNCTION_CALL_CANCELLED


def test_the_oldest_turns_go_whole_past_the_policy() -> None:
    h = ChatHistory(HistoryPolicy(max_turns=2, max_chars=10_000))
    for i in range(4):
        h.user(f"question {i}")
        h.begin_reply(f"r{i}")
        h.tool_call(f"r{i}", f"c{i}", "f", "{}")
        h.generated(f"r{i}", f"answer {i}")
        h.reply_ended(f"r{i}", completed=True)
    assert [m.content for m in h.messages] == ["question 2", "answer 2", "question 3", "answer 3"]
    assert [c.call_id for m in h.messages for c in m.calls] == ["c2", "c3"]
    small = ChatHistory(HistoryPolicy(max_turns=100, max_chars=60))
    for i in range(5):
        small.user(f"a question that is long enough {i}")
    assert small.chars() <= 60 and small.messages[-1].text.endswith("4")
    long = ChatHistory(HistoryPolicy(max_turns=10, max_chars=100))
    long.user("q")
    long.begin_reply("r")
    long.tool_call("r", "c", "f", "{}")
    long.answer("c", "x" * 1000)
    assert len(long.messages[-1].calls[0].output) == 50  # cut to half the characters


def test_the_records_rebuild_the_history_as_heard() -> None:
    h = ChatHistory(HistoryPolicy())
    h.user("hello")
    spoken_reply(h)
    h.tool_call("r1", "c1", "f", '{"a": 1}')
    h.sent("r1", 1000)
    h.reply_ended("r1", completed=False)
    records = h.records()
    assert records == [
        ["u", "hello"],
        ["a", "The first sentence.", [["c1", "f", '{"a": 1}', "cancelled", ""]]],
    ]
    again = ChatHistory.from_records(records, HistoryPolicy())
    assert again.records() == records
    for bad in ("x", [["q", "x"]], [["a", "x", [["c", "f", "{}", "weird", ""]]]], [["u", 3]]):
        with pytest.raises(ValueError):
            ChatHistory.from_records(bad, HistoryPolicy())

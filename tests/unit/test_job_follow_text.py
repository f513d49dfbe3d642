"""The text a job's event stream adds up to, and what completes it to the stored text (issue 31)."""

from __future__ import annotations

from api.job_follow import completion, rebuilt


def test_a_stream_is_completed_to_the_stored_text_from_where_it_differs() -> None:
    text = rebuilt(rebuilt("", 0, "Notice "), 7, "of twelve")
    assert text == "Notice of twelve"
    assert completion(text, "Notice of twelve days\ufffd") == (16, " days\ufffd")
    assert completion("Notice of twelfth", "Notice of twelve") == (14, "ve")  # a changed tail
    assert completion(text, text) is None
    assert rebuilt("abc", 0, "x") == "x"  # a retry starts again at offset 0

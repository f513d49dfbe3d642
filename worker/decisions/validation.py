"""Validation of free text decoded inside a JSON string (the optional rationale).

Choices can never be invalid (their slots are restricted); a rationale is unrestricted, so it
must be checked: the raw decoded text must stay a valid JSON string body and be readable.
"""

from __future__ import annotations

# Characters that would end or escape the JSON string the rationale sits in.
JSON_BREAKING = frozenset('"\\')


def rationale_problem(text: str, *, max_chars: int) -> str | None:
    """Why ``text`` is not an acceptable rationale, or None when it is.

    Acceptable: non-empty after stripping, at most ``max_chars`` characters, printable (no
    control characters, no undecodable bytes), and no JSON-breaking characters.
    """
    stripped = text.strip()
    if not stripped:
        return "empty rationale"
    if len(stripped) > max_chars:
        return f"rationale longer than {max_chars} characters"
    if "\ufffd" in stripped:
        return "rationale is not valid UTF-8 text"
    if not stripped.isprintable():
        return "rationale contains control characters"
    if JSON_BREAKING.intersection(stripped):
        return "rationale contains JSON-breaking characters"
    return None

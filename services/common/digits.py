"""Whole numbers written in text that came from outside (environment, headers, command output)."""
from __future__ import annotations


def as_count(text: str) -> int | None:
    """The non-negative integer that ``text`` spells in ASCII digits, surrounding whitespace
    allowed (``" 42\\n"`` -> 42); None for anything else (empty, a sign, '²'). ``str.isdigit``
    alone takes '²' and other Unicode digits that ``int()`` then refuses with a ValueError."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None

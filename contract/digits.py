"""Whole numbers written in ASCII digits, the only ones a client or an operator should send.

`str.isdigit()` is true of superscripts and other Unicode digits that `int()` refuses (`"¹".isdigit()` and a
ValueError), so a check with it lets a crafted query string or header reach `int()` and a 500.
"""

from __future__ import annotations


def ascii_digits(text: str) -> bool:
    """True when `text` is one or more of 0-9 and nothing else, so `int(text)` cannot fail."""
    return text.isascii() and text.isdigit()

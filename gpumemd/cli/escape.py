"""Text from a file someone sent, made safe to print on a terminal.

A report.json string or a pickle's bytes may hold terminal escapes (clear the screen, move the cursor,
print a fake "snapshot OK"), bidirectional overrides that reorder what is shown, a newline that forges
a line of our output, or a lone surrogate that stops the print itself. ``escaped`` writes each such
character as its Python escape, so what is printed is what the file holds, on one line.
"""

from __future__ import annotations

import re

# C0 and C1 controls (newline and tab included: one value is one line), DEL, the bidirectional marks,
# embeddings, overrides and isolates, the BOM and lone surrogates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def escaped(text: str) -> str:
    """``text`` with every control, bidirectional and unprintable character written as its escape."""
    return _UNSAFE.sub(_escape, text)

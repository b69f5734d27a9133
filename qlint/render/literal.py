"""Names from the model shown literally: control characters become visible escapes.

Module names, file names and messages come from the user's model and files. In a
terminal, an ESC sequence in a name would recolour or rewrite the screen; in a CI log a
newline would start a new line that the runner reads as a command (``::error``). So
every control, format and line-separator character is shown as its Python escape
(``\\n``, ``\\x1b``, ``\\u202e``); everything else, including non-ASCII letters, is
kept as it is.
"""

from __future__ import annotations

import unicodedata

# Cc: C0/C1 controls and DEL; Cf: format characters such as bidi overrides (which reorder
# what is shown); Zl/Zp: the Unicode line and paragraph separators.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _escape(char: str) -> str:
    code = ord(char)
    if char == "\n":
        return "\\n"
    if char == "\r":
        return "\\r"
    if char == "\t":
        return "\\t"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` with every control/format/line-separator character written as an escape."""
    value = str(text)
    if value.isprintable():  # fast path: nothing to escape (spaces count as printable)
        return value
    return "".join(_escape(c) if unicodedata.category(c) in _ESCAPED_CATEGORIES else c for c in value)

"""The one escaping of text that reaches a terminal, a log or a Markdown page.

File names, cell ids, reasons and messages come from directories and documents a user (or
an attacker) controls. Printed raw, a name holding a newline forges a line of output (a
fake ``[ok] 5.`` step of ``qualify verify``), an ANSI escape rewrites the screen, a bidi
control reorders what is read, and a name that is not UTF-8 (decoded by Python with
``surrogateescape``) makes the print itself raise. :func:`printable` turns every such
character into a visible escape, so one logical item is always one visible run of text.
Every place that prints a file name or a user-controlled string goes through it: the
error line of :func:`qualify.cli.main.main`, ``verify`` steps, ``gate`` and ``audit``
output, ``report.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = ["markdown_cell", "printable", "printable_lines"]

_NAMED: Final[dict[str, str]] = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object) -> str:
    r"""``str(text)`` with every character that is not printable escaped, repr-style.

    A character is kept when :meth:`str.isprintable` says so, or it is a plain space;
    every other one (C0 and C1 controls including newline, carriage return, tab and
    ESC; DEL; Unicode format characters such as the bidi overrides U+202A-U+202E and
    U+2066-U+2069 and zero-width joiners; line and paragraph separators; surrogates left
    by ``surrogateescape``; unassigned and private-use code points) becomes ``\n``,
    ``\r``, ``\t``, ``\xNN``, ``\uNNNN`` or ``\UNNNNNNNN``.

    Args:
        text: anything; ``str()`` of it is escaped.

    Returns:
        One line of printable text (no newline), encodable as UTF-8.
    """
    s = str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() or ch == " " else _escape(ch) for ch in s)


def printable_lines(lines: Iterable[object]) -> list[str]:
    """:func:`printable` of each line: an item with an embedded newline stays one line."""
    return [printable(line) for line in lines]


def markdown_cell(text: object) -> str:
    r""":func:`printable` text for a Markdown table cell (``|`` escaped as ``\|``)."""
    return printable(text).replace("|", "\\|")

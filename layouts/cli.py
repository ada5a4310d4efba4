"""Command-line helpers shared by every CLI of the project (``python -m layouts explain``,
``python -m canonical_ops demo|store``): a parser whose usage errors are ONE line on stderr
(exit 2, never a traceback), ``--help`` with the defaults, bounded integer flags (``8`` yes,
``1.5`` no), case-insensitive choices, and :func:`escape_text`, the one way untrusted text
(names read from a store or a config, paths, server messages) reaches a human-readable line.
Standard library only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = ["CliParser", "HelpFormatter", "escape_text", "float_in", "int_in", "lower"]
__all__ += ["run_console", "upper"]

_NAMED_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(char: str) -> str:
    """One character as Python writes it in a string literal (``\\n``, ``\\x1b``, ``\\u202e``)."""
    if char in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_text(value: object) -> str:
    r"""``value`` as text fit for one line of a human-readable output: every character
    Unicode classes as "Other" or "Separator" (controls such as newline and ESC, format
    characters such as bidi overrides, line/paragraph separators, unassigned and private
    code points, spaces other than the ASCII space) is written as an escape (``\n``,
    ``\x1b``, ``\u202e``), and a backslash as ``\\`` so no escape can be forged. Untrusted
    text (a name read from a store or a config, a path, a server's message) thereby cannot
    end a line, start a forged one, or drive the terminal. JSON outputs keep the exact value."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and "\\" not in text:  # str.isprintable: exactly the rule above
        return text
    return "".join(c if c.isprintable() and c != "\\" else _escape_char(c) for c in text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs kept as written; every flag with a default shows it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help  # "(default: None)" says nothing
        return super()._get_help_string(action)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit status 2 (its
    subparsers too); ``fail`` reports errors found after parsing the same way."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # one line, whatever the message holds: whitespace runs become one space, the rest
        # of what could end or forge a line, or drive a terminal, is escaped
        message = escape_text(" ".join(str(message).split()))
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def fail(self, message: str) -> NoReturn:
        self.error(message)


def int_in(minimum: int, maximum: int) -> Callable[[str], int]:
    """argparse ``type``: a base-10 integer in [minimum, maximum]; ``1.5`` or ``1e9`` is refused."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{minimum}, {maximum}], got {text!r}"
            ) from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{minimum}, {maximum}], got {value}"
            )
        return value

    parse.__name__ = "int"
    return parse


def float_in(minimum_exclusive: float, maximum: float) -> Callable[[str], float]:
    """argparse ``type``: a finite number in (minimum_exclusive, maximum]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and minimum_exclusive < value <= maximum):
            raise argparse.ArgumentTypeError(
                f"expected a number > {minimum_exclusive:g} and <= {maximum:g}, got {text!r}"
            )
        return value

    parse.__name__ = "float"
    return parse


def lower(text: str) -> str:
    """argparse ``type`` of case-insensitive lower-case choices (``--packing SPLIT``)."""
    return text.lower()


def upper(text: str) -> str:
    """argparse ``type`` of case-insensitive upper-case choices (``--order nhd``)."""
    return text.upper()


def run_console(main: Callable[[], int]) -> int:
    """``main()`` for the console: a reader that stops reading (``| head``) is no error."""
    try:
        return main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 141

"""Names as a recording holds them and as people type them: step names, paper labels, module paths.

What is recorded is kept as the program had it. Printed, a name's control characters are escaped
(``shown``: ``\\n``, ``\\t``, ``\\x1b``, a bidirectional override ``\\u202e``), so that one name is one
piece of one line. Typed back (a selector, a filter, ``modules=``), a name is compared with the
recorded one under Unicode normalisation, on both sides: NFC (``é`` typed as one character matches the
``e`` and combining accent a PDF or a macOS file name gives), and NFKC where the recorded name is a
Python identifier, as Python normalises identifiers itself (``def ﬁlter_ｓｔｅｐ`` is recorded as
``filter_step``, and either spelling selects it); the escaped form a listing shows matches too.
"""

from __future__ import annotations

import fnmatch
import unicodedata
from functools import lru_cache

# Control characters (C0 but tab and newline, DEL, C1), bidirectional controls and the line and
# paragraph separators, as \xNN / \uNNNN: a recording's names and messages may hold terminal escape
# sequences (a shared bundle is data from elsewhere), which would otherwise reach the terminal (pdbg's
# output, a repr in a Python prompt). Tab and newline are pdbg's own layout in what it prints.
ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0))}
ESCAPES.update({c: f"\\u{c:04x}" for c in (0x061c, 0x200e, 0x200f, 0x2028, 0x2029, *range(0x202a, 0x202f),
                                            *range(0x2066, 0x206a))})
# In a name, a tab or a newline is the name's own (a ModuleDict key "a\nb"): escaped too.
NAME_ESCAPES = {**ESCAPES, 0x09: "\\t", 0x0a: "\\n", 0x0d: "\\r"}


def printable(text: str) -> str:
    """``text`` with control characters escaped (``ESCAPES``): for a repr a terminal may print."""
    return text.translate(ESCAPES)


@lru_cache(maxsize=8192)
def shown(text: str) -> str:
    """A name, label or module path as pdbg prints it: every control character escaped, tab and
    newline too (``NAME_ESCAPES``), so that it stays one piece of one line."""
    return text.translate(NAME_ESCAPES)


@lru_cache(maxsize=8192)
def _nfc(text: str) -> str:
    return text if text.isascii() else unicodedata.normalize("NFC", text)


@lru_cache(maxsize=8192)
def _nfkc(text: str) -> str:
    return text if text.isascii() else unicodedata.normalize("NFKC", text)


@lru_cache(maxsize=8192)
def _identifier(text: str) -> bool:
    """Whether ``text`` is written as Python identifiers (dotted ones too: ``Block.forward``)."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


@lru_cache(maxsize=8192)
def _forms(recorded: str) -> tuple[str, ...]:
    """What a recorded name is compared as: NFC, as it is and as printed (``shown``)."""
    printed = shown(recorded)
    return (_nfc(recorded),) if printed == recorded else (_nfc(recorded), _nfc(printed))


def same(typed: str, recorded: str | None) -> bool:
    """Whether ``typed`` names ``recorded`` (a step name, paper label or module path): equal under NFC,
    under NFKC where ``recorded`` is an identifier, or equal to the form pdbg prints it in."""
    if recorded is None:
        return False
    if typed == recorded:
        return True
    if _nfc(typed) in _forms(recorded):
        return True
    return _identifier(_nfkc(recorded)) and _nfkc(typed) == _nfkc(recorded)


def glob(recorded: str, pattern: str) -> bool:
    """``fnmatch.fnmatchcase(recorded, pattern)`` under the normalisation of ``same``; and a pattern
    spelled exactly as the name matches it, whatever wildcards it holds (``x[0]``: the key "x[0]", as
    well as "x0")."""
    if same(pattern, recorded):
        return True
    folded = _nfc(pattern)
    if any(fnmatch.fnmatchcase(form, folded) for form in _forms(recorded)):
        return True
    return _identifier(_nfkc(recorded)) and fnmatch.fnmatchcase(_nfkc(recorded), _nfkc(pattern))


def search_text(text: str) -> str:
    """A name as a substring search (the TUI's filter) looks in it: NFKC, case folded, and its printed
    form beside it (so that ``\\n`` typed finds the name that holds a newline)."""
    printed = shown(text)
    both = text if printed == text else f"{text} {printed}"
    return _nfkc(both).casefold()


def search_key(text: str) -> str:
    """What a search typed by the user looks for (in ``search_text``): NFKC, case folded."""
    return _nfkc(text).casefold()

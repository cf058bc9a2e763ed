"""A confusables skeleton for the rules that read text addressed to a grader.

NFKC folds compatibility forms (fullwidth ``ＧＲＡＤＥＲ``, ligatures, circled letters) but leaves
three ways to write a word a reader takes for another: letters of another script that look the
same (Cyrillic ``а``, Greek ``ο`` in ``grаdеr``), format and invisible characters between
letters (zero-width space and joiners, soft hyphen, word joiner, Unicode tag characters) and
combining marks or variation selectors on letters (``ǵrader``, ``g\ufe0frader``). An LLM grader
reads all of them as the word; a regular expression does not.

:func:`skeleton` maps text to a form in which those variants coincide, in the manner of Unicode
TR39's skeleton (``UTS #39``, section 4): NFKD; every character of category ``Cf`` (format:
zero-width characters, bidi controls, tag characters), ``Mn``/``Me`` (combining marks and
variation selectors) and the default-ignorable fillers removed; each letter of the table below
replaced by the Latin letter it is confused with; NFKC again; casefolded. The table covers the
Cyrillic and Greek letters that look like Latin ones and a few Latin look-alikes (dotless i,
script g, small capitals); it is this module's own, not the full Unicode ``confusables.txt``.

The skeleton is for matching only: it is never shown to anyone, and it does not keep offsets.
"""

from __future__ import annotations

import functools
import unicodedata

__all__ = ["skeleton"]

# Look-alikes of Latin letters: Cyrillic, Greek, and Latin letters of other shapes.
_TABLE = {
    # Cyrillic lower case
    "а": "a", "в": "b", "е": "e", "ё": "e", "г": "r", "һ": "h", "і": "i", "ї": "i", "ј": "j",
    "к": "k", "ӏ": "l", "м": "m", "н": "h", "о": "o", "п": "n", "р": "p", "с": "c", "ԁ": "d",
    "ѕ": "s", "т": "t", "у": "y", "ү": "y", "х": "x", "ԛ": "q", "ԝ": "w", "ь": "b", "ɡ": "g",
    "ц": "u", "ш": "w", "щ": "w", "ѵ": "v", "ѡ": "w", "ӕ": "ae",
    # Cyrillic upper case
    "А": "A", "В": "B", "Е": "E", "Ё": "E", "З": "3", "Н": "H", "І": "I", "Ї": "I", "Ј": "J",
    "К": "K", "М": "M", "О": "O", "Р": "P", "С": "C", "Ѕ": "S", "Т": "T", "У": "Y", "Х": "X",
    "Ү": "Y", "Ԁ": "D", "Ԛ": "Q", "Ԝ": "W", "Ӏ": "I", "Ь": "b",
    # Greek lower case
    "α": "a", "β": "b", "γ": "y", "δ": "d", "ε": "e", "η": "n", "ι": "i", "κ": "k", "ν": "v",
    "ο": "o", "ρ": "p", "σ": "o", "ς": "c", "τ": "t", "υ": "u", "χ": "x", "ω": "w", "ϲ": "c",
    "ϳ": "j", "ɑ": "a",
    # Greek upper case
    "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N",
    "Ο": "O", "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X", "Ϲ": "C", "Ϳ": "J",
    # Latin look-alikes
    "ı": "i", "ȷ": "j", "ʀ": "r", "ɢ": "g", "ʜ": "h", "ɪ": "i", "ʟ": "l", "ɴ": "n", "ᴀ": "a",
    "ᴄ": "c", "ᴅ": "d", "ᴇ": "e", "ᴊ": "j", "ᴋ": "k", "ᴍ": "m", "ᴏ": "o", "ᴘ": "p", "ᴛ": "t",
    "ᴜ": "u", "ᴠ": "v", "ᴡ": "w", "ᴢ": "z", "ſ": "s", "ℓ": "l",
}  # fmt: skip  # a lookup table reads best in rows
_MAP = str.maketrans(_TABLE)
# Default-ignorable code points that are not of category Cf (Hangul fillers, the combining
# grapheme joiner's neighbours, Mongolian variation selectors are Mn and go with the marks).
_IGNORABLE = frozenset("\u115f\u1160\u3164\uffa0\u2800")
_DROP = frozenset(("Cf", "Mn", "Me"))


@functools.lru_cache(maxsize=4096)
def _char_dropped(c: str) -> bool:
    return c in _IGNORABLE or unicodedata.category(c) in _DROP


def skeleton(text: str) -> str:
    """``text`` with confusable spellings made one (see the module docstring); linear time."""
    if text.isascii():
        return text.casefold()
    t = unicodedata.normalize("NFKD", text)
    t = "".join(c for c in t if not _char_dropped(c))
    t = unicodedata.normalize("NFKC", t.translate(_MAP))
    return t.casefold()

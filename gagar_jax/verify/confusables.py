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
replaced by the Latin letter (or digit) it is confused with; NFKC again; casefolded. The
look-alikes are Unicode's own (``confusables.txt`` of UTS #39, every script: Cherokee, Canadian
syllabics, Lisu, Coptic, mathematical alphanumerics...), read from the data the
``confusable-homoglyphs`` distribution ships, with this module's table taking precedence (it
sends Cyrillic ``н`` to ``h`` as a reader sees it rather than to Unicode's prototype). Only
characters outside ASCII are replaced: ASCII text is its own skeleton (``I``, ``l`` and ``1``
stay apart, so Latin words keep their spelling).

:func:`poses_as_latin` says which characters of a word are such look-alikes where the word is
written (or mixed) with Latin letters; ``untrusted.sanitize`` shows those as ``\\uXXXX`` escapes in
every grader view, so a word cannot read as Latin to the grader unless it is Latin.

The skeleton is for matching only: it is never shown to anyone, and it does not keep offsets.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
import unicodedata

__all__ = ["latin_lookalike", "poses_as_latin", "skeleton"]

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
_DATA_PACKAGE = "confusable_homoglyphs"  # Unicode's confusables.txt as {char: [{"c": ...}]}


def _preference(source: str, target: str) -> tuple:
    """Order of the ASCII prototypes a character is listed with: letters first, the source's
    case, one character before several."""
    letters = target.isalpha()
    same_case = source.isupper() == target.isupper() if letters else False
    return (not letters, not same_case, len(target), target)


@functools.lru_cache(maxsize=1)
def _unicode_table() -> dict[str, str]:
    """Every non-ASCII character Unicode lists as confusable with ASCII letters or digits,
    mapped to them (``Ꭲ`` -> ``T``, ``ᗅ`` -> ``A``)."""
    raw = importlib.resources.files(_DATA_PACKAGE).joinpath("confusables.json").read_text("utf-8")
    out = {}
    for source, entries in json.loads(raw).items():
        if len(source) != 1 or source.isascii():
            continue
        targets = [
            e["c"] for e in entries if e["c"].isascii() and e["c"].isalnum() and len(e["c"]) <= 3
        ]
        if targets:
            out[source] = min(targets, key=lambda t: _preference(source, t))
    return out


@functools.lru_cache(maxsize=1)
def _map() -> dict[int, str]:
    return str.maketrans({**_unicode_table(), **_TABLE})


# Default-ignorable code points that are not of category Cf (Hangul fillers, the combining
# grapheme joiner's neighbours, Mongolian variation selectors are Mn and go with the marks).
_IGNORABLE = frozenset("\u115f\u1160\u3164\uffa0\u2800")
_DROP = frozenset(("Cf", "Mn", "Me"))


@functools.lru_cache(maxsize=4096)
def _char_dropped(c: str) -> bool:
    return c in _IGNORABLE or unicodedata.category(c) in _DROP


# A right-to-left override or isolate and what it shows reversed, up to its terminator or the
# end of the line (``\u202eREDARG`` is displayed as GRADER).
_RTL_RUN_RE = re.compile("[\u202e\u2067]([^\u202c\u2069\n]*+)")


def skeleton(text: str) -> str:
    """``text`` with confusable spellings made one (see the module docstring); linear time.
    Runs under a right-to-left override are read in the order they are displayed."""
    if text.isascii():
        return text.casefold()
    if "\u202e" in text or "\u2067" in text:
        text = _RTL_RUN_RE.sub(lambda m: m.group(1)[::-1], text)
    t = unicodedata.normalize("NFKD", text)
    t = "".join(c for c in t if not _char_dropped(c))
    t = unicodedata.normalize("NFKC", t.translate(_map()))
    return t.casefold()


@functools.lru_cache(maxsize=8192)
def latin_lookalike(c: str) -> str | None:
    """The ASCII letters or digits the non-ASCII character ``c`` reads as (Unicode's
    confusables, this module's table, compatibility forms such as fullwidth and mathematical
    letters), or None."""
    if c.isascii():
        return None
    mapped = _TABLE.get(c) or _unicode_table().get(c)
    if mapped is None:
        folded = unicodedata.normalize("NFKC", c)
        mapped = folded if folded != c and folded.isascii() and folded.isalnum() else None
    elif len(mapped) > 1 and _script(c) == "LATIN":
        return None  # a Latin letter of its own (``Æ``, ``ß``), not a disguise of two
    return mapped


def _script(c: str) -> str:
    """The first word of a character's Unicode name (``LATIN``, ``CHEROKEE``, ``GREEK``)."""
    return unicodedata.name(c, "?").split(" ", 1)[0]


def poses_as_latin(word: str) -> list[int]:
    """Positions in ``word`` (a run of word characters) of characters that pass it off as
    Latin: where the word mixes scripts (ASCII letters with others, or two scripts), every
    non-ASCII character with a Latin look-alike and every letter not of the Latin script
    (``NOᎢᎬ``, ``ᑎᎾᎢᎬ``); in a word of one other script, its look-alikes when every letter
    has one (``ᎢᎻᎬ``). Latin letters with accents (``café``) and words of another script that
    merely contain look-alikes (Russian ``привет``) are left alone."""
    if word.isascii():
        return []
    look = [i for i, c in enumerate(word) if latin_lookalike(c) is not None]
    foreign = [i for i, c in enumerate(word) if _foreign(c)]
    if not look and not foreign:
        return []
    letters = [c for c in word if c.isalpha()]
    scripts = {"LATIN" if c.isascii() else _script(c) for c in letters}
    if any(c.isascii() and c.isalnum() for c in word) or len(scripts) > 1:
        return sorted(set(look) | set(foreign))
    return look if len(look) == len(letters) else []


@functools.lru_cache(maxsize=1)
def _lookalike_scripts() -> frozenset[str]:
    """Scripts with letters Unicode lists as Latin look-alikes (Cherokee, Greek, Canadian
    syllabics...): a letter of one of them inside a Latin word is posing."""
    return frozenset(_script(c) for c in _unicode_table()) - {"LATIN"}


@functools.lru_cache(maxsize=8192)
def _foreign(c: str) -> bool:
    return not c.isascii() and c.isalpha() and _script(c) in _lookalike_scripts()

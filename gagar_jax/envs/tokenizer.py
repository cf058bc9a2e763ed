"""A deterministic word-level tokenizer for toy code-repair text.

The vocabulary is fixed (no training, no file): special tokens, the newline, toy keywords,
operators and punctuation, a small set of variable names, and the integers ``0..MAX_INT`` as
whole tokens. A patch such as ``1 : a = x + 3`` is 7 tokens, short enough for a tiny policy
trained from scratch to explore.

``decode(encode(t)) == t`` for canonical text (tokens separated by single spaces, lines by
``\\n``), which is what every ToyTask prompt and reference patch is. Words outside the vocabulary
encode to ``unk_id`` (or raise with ``strict=True``).

Character offsets (``encode_with_offsets``): each token's ``[start, end)`` interval in the text,
from any tokenizer the families and their feedback records use (the toy tokenizer locates its
words in the text; a ``tokenizers.Tokenizer`` or a ``transformers`` fast tokenizer reports its
own). The simulated users and the feedback records (``gagar_jax.data.feedback``) map character
ranges to tokens with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gagar_jax.verify.toy_lang import lex

MAX_INT = 99
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
NEWLINE = "\n"
WORDS = (
    # structure of prompts and patches
    "program", "tests", "patch", "f", "return", "if", "ins", "del",
    # operators and punctuation
    ":", "=", "+", "-", "*", "(", ")", "==", "!=", "<", ">", "<=", ">=",
    # variables: the input, the names programs use, and names they never use (style probes)
    "x", "a", "b", "c", "d", "e", "t", "u", "v", "w", "y", "z", "tmp",
)  # fmt: skip  # one row per vocabulary group


class ToyTokenizer:
    """Fixed-vocabulary tokenizer; ids are stable across runs and machines."""

    def __init__(self, max_int: int = MAX_INT):
        if max_int < 9:
            raise ValueError(f"max_int must be >= 9, got {max_int}")
        self.vocab: tuple[str, ...] = (
            SPECIALS + (NEWLINE,) + WORDS + tuple(str(i) for i in range(max_int + 1))
        )
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        self.max_int = max_int
        self.pad_id, self.eos_id, self.bos_id, self.unk_id = 0, 1, 2, 3
        self.newline_id = self._ids[NEWLINE]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def token_id(self, token: str) -> int:
        """Id of one vocabulary word; KeyError naming the word if it is not in the vocabulary."""
        try:
            return self._ids[token]
        except KeyError:
            raise KeyError(f"{token!r} is not in the toy vocabulary") from None

    def encode(self, text: str, *, strict: bool = False) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS); unknown words -> unk_id (ValueError if strict)."""
        ids: list[int] = []
        for n, line in enumerate(text.split(NEWLINE)):
            if n:
                ids.append(self.newline_id)
            for tok in lex(line):
                i = self._ids.get(tok)
                if i is None:
                    if strict:
                        raise ValueError(
                            f"word {tok!r} (line {n + 1}) is not in the toy vocabulary"
                        )
                    i = self.unk_id
                ids.append(i)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each token's ``[start, end)`` character interval in ``text`` (a
        newline token covers its ``\\n``)."""
        ids = self.encode(text)
        offsets: list[tuple[int, int]] = []
        base = 0
        for n, line in enumerate(text.split(NEWLINE)):
            if n:
                offsets.append((base - 1, base))  # the newline token
            cursor = 0
            for word in lex(line):
                start = line.index(word, cursor)
                offsets.append((base + start, base + start + len(word)))
                cursor = start + len(word)
            base += len(line) + 1
        if len(offsets) != len(ids):  # cannot happen: encode lexes the same lines; guard it
            raise RuntimeError(f"toy offsets: {len(offsets)} offsets for {len(ids)} tokens")
        return ids, offsets

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Canonical text of ``ids``; pad and BOS are dropped, decoding stops at EOS by default."""
        lines: list[list[str]] = [[]]
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i in (self.pad_id, self.bos_id) or i == self.eos_id:
                continue
            if not 0 <= i < len(self.vocab):
                raise ValueError(f"token id {i} out of range [0, {len(self.vocab)})")
            if i == self.newline_id:
                lines.append([])
            else:
                lines[-1].append(self.vocab[i])
        return NEWLINE.join(" ".join(line) for line in lines)


TOKENIZER = ToyTokenizer()


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` and each token's ``[start, end)`` character interval in it.

    ``tokenizer``: anything with an ``encode_with_offsets(text)`` method (the toy tokenizer), a
    ``transformers`` fast tokenizer or a ``tokenizers.Tokenizer``; another is a TypeError naming
    it."""
    if hasattr(tokenizer, "encode_with_offsets"):
        ids, offsets = tokenizer.encode_with_offsets(text)
        return list(ids), [tuple(o) for o in offsets]
    if callable(tokenizer) and hasattr(tokenizer, "is_fast"):  # transformers fast tokenizer
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    enc = tokenizer.encode(text)  # tokenizers.Tokenizer
    if not hasattr(enc, "offsets"):
        raise TypeError(
            f"tokenizer {type(tokenizer).__name__} gives no character offsets: "
            "give it an encode_with_offsets(text) method"
        )
    return list(enc.ids), [tuple(o) for o in enc.offsets]

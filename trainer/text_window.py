"""How much of a long text `max_length` tokens can use: a cell is cut to that many characters
before it is tokenized, so one huge cell costs what a full row costs, not what its length does.

A tokenizer spends tens of bytes per character of what it is given (a 30 MB text took 5 GB)
and truncates only afterwards. No token covers more of a text than its vocabulary entry is
long (a WordPiece "##" or a byte-level BPE's one character per byte only adds), so
`max_length` tokens cover at most `max_length` times the longest entry, in characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Characters per token where the tokenizer's vocabulary cannot be read: GPT-2's longest entry
# (a run of 128 characters), longer than BERT's, RoBERTa's or Llama's.
FALLBACK_TOKEN_CHARS = 128
# Tokens of room past max_length: the word the cut falls in, special tokens.
SPARE_TOKENS = 8


def longest_token_chars(tokenizer: Any) -> int:
    """The longest entry of the tokenizer's vocabulary (its added tokens included), in
    characters; FALLBACK_TOKEN_CHARS where it has no vocabulary to read."""
    try:
        vocabulary = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return FALLBACK_TOKEN_CHARS
    return max(map(len, vocabulary), default=FALLBACK_TOKEN_CHARS)


def window_chars(tokenizer: Any, max_length: int) -> int:
    """The characters of a text that `max_length` tokens can reach, with room to spare."""
    return (max_length + SPARE_TOKENS) * longest_token_chars(tokenizer)


def heads(texts: Sequence[str], chars: int) -> list[str]:
    """Each text's first `chars` characters (a shorter text as it is)."""
    return [text[:chars] for text in texts]


def tails(texts: Sequence[str], chars: int) -> list[str]:
    """Each text's last `chars` characters: a prompt, which loses its start first."""
    return [text[-chars:] if len(text) > chars else text for text in texts]


def cut_words(words: list[str], chars: int) -> list[str]:
    """The first words of a row whose characters `chars` bounds: words are kept whole while
    the ones before them hold fewer than `chars`, and one longer than that is cut to it."""
    kept: list[str] = []
    total = 0
    for word in words:
        if total >= chars:
            break
        kept.append(word[:chars])
        total += len(word)
    return kept

"""A long text cut into segments a speech model speaks one after another (pure string work, no model).

One rule for English, Chinese and their mix: cut at sentence ends first, then at clause marks, then between
words, then between characters, and only as finely as a segment's size budget needs:

    sentence   . ! ? …  followed by a space or the end;  。 ！ ？ anywhere;  a line break
    clause     , ; :    followed by a space or the end;  ， 、 ； ： anywhere
    word       after a run of spaces
    character  any (a single word longer than the budget)

Closing quotes and brackets after a mark stay with their sentence, and the spaces after a cut go with the
piece before it, so every segment but the first starts with a word. Consecutive pieces are packed greedily
into segments of at most max_size (as `size` measures them: characters by default, a model's text tokens in
`omnimtp.families.text.ChatText.speech_segments`). The segments joined are the text, character for character.

    >>> split_text("One. Two, three. Four five six.", 12)
    ['One. ', 'Two, three. ', 'Four five ', 'six.']
    >>> split_text("你好。今天天气很好，我们去公园吧！", 8)
    ['你好。', '今天天气很好，', '我们去公园吧！']
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator

_CLOSERS = re.escape("\"'”’」』）)]}》")
# Each level's cut points: the end of each match (a mark, its closers and the spaces after it).
_LEVELS = (
    re.compile(rf"(?:[.!?…]+[{_CLOSERS}]*(?:\s+|$)|[。！？]+[{_CLOSERS}]*\s*|\n\s*)"),
    re.compile(rf"(?:[,;:]+[{_CLOSERS}]*(?:\s+|$)|[，、；：]+[{_CLOSERS}]*\s*)"),
    re.compile(r"\s+"),
)


def split_text(text: str, max_size: int, size: Callable[[str], int] = len) -> list[str]:
    """`text` as consecutive segments of at most max_size each (see the module docstring); [text] when it
    fits. A single character larger than max_size is a segment of its own (nothing can cut it)."""
    return list(iter_segments(text, max_size, size))


def iter_segments(text: str, max_size: int, size: Callable[[str], int] = len) -> Iterator[str]:
    """`split_text`'s segments one at a time: each is cut when it is asked for, so the first costs about what
    a short text's would, however long the rest is."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a string, got {type(text).__name__}")
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"max_size must be an integer >= 1, got {max_size!r}")
    return _split(text, 0, max_size, size) if text else iter(())


def _split(text: str, level: int, max_size: int, size: Callable[[str], int]) -> Iterator[str]:
    if size(text) <= max_size or (level == len(_LEVELS) and len(text) == 1):
        yield text
        return
    pieces = _pieces(text, level)
    if len(pieces) == 1:
        yield from _split(text, level + 1, max_size, size)
        return
    current = ""
    for piece in pieces:
        if current and size(current + piece) <= max_size:
            current += piece
            continue
        if current:
            yield current
        current = piece
        if size(piece) > max_size:  # too long alone: cut finer, and the next piece starts a new segment
            yield from _split(piece, level + 1, max_size, size)
            current = ""
    if current:
        yield current


def _pieces(text: str, level: int) -> list[str]:
    """`text` cut after each of the level's marks (characters past the last level)."""
    if level == len(_LEVELS):
        return list(text)
    cuts = [match.end() for match in _LEVELS[level].finditer(text) if 0 < match.end() < len(text)]
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[start:end] for start, end in itertools.pairwise(bounds) if end > start]

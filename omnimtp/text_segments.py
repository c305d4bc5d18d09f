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
from dataclasses import dataclass

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


def _split(text: str, level: int, max_size: int, size: Callable[[str], int],
           is_open: bool = False) -> Iterator[str | OpenSegment]:
    """The segments of `text` at `level`. is_open: more text may follow `text`, so only segments no later text
    can change are yielded, then the rest as an `OpenSegment`. Later text can only grow the last piece (a cut
    needs the character after its mark, or a space), so a segment is final once a piece after it is too large
    to join it."""
    if level == len(_LEVELS) and len(text) == 1:  # a character: nothing can cut it, nor join it once too large
        yield text if not is_open or size(text) > max_size else OpenSegment(text, len(text))
        return
    if size(text) <= max_size:
        yield OpenSegment(text, _num_certain(text, level)) if is_open else text
        return
    pieces = _pieces(text, level)
    if len(pieces) == 1:
        yield from _split(text, level + 1, max_size, size, is_open)
        return
    current = ""
    for i, piece in enumerate(pieces):
        is_last_open = is_open and i == len(pieces) - 1
        if current and size(current + piece) <= max_size:
            if is_last_open:  # the open piece may still outgrow the segment: what came before it is certain
                yield OpenSegment(current + piece, len(current))
                return
            current += piece
            continue
        if current:
            yield current
        current = piece
        if size(piece) > max_size:  # too long alone: cut finer, and the next piece starts a new segment
            yield from _split(piece, level + 1, max_size, size, is_last_open)
            current = ""
        elif is_last_open:
            yield OpenSegment(piece, _num_certain(piece, level))
            return
    if current:
        yield current


def _num_certain(text: str, level: int) -> int:
    """How many leading characters of an open `text` that fits (a segment of its own so far, at `level`) stay in
    its segment whatever follows: its pieces before the last at the first level that cuts it (if it outgrows the
    budget, greedy packing keeps them, as they fit); all of a piece of characters. (The last piece is never
    certain: even one that ends in spaces may outgrow the segment as they become spaces inside it.)"""
    while level < len(_LEVELS):
        pieces = _pieces(text, level)
        if len(pieces) > 1:
            return len(text) - len(pieces[-1])
        level += 1
    return len(text)


@dataclass(frozen=True)
class OpenSegment:
    """The segment still being written: its text so far, of which the first num_certain characters stay in it
    whatever text follows (the rest may yet move to the next segment)."""

    text: str
    num_certain: int


class SegmentStream:
    """`iter_segments` of a text that arrives in pieces: `push(piece)` → the segments that became final,
    `finish()` → the rest; joined, they are `split_text(whole text, max_size, size)`, however the text was split
    (given that a text's size does not shrink as it grows, as a count of characters or tokens does not).

    A segment is final once a piece after it cannot join it (a sentence end followed by more text, with that
    text too large to share the segment) or the text ends, so a long text's first segment is final long before
    the text is complete. `open` is the segment being written (an `OpenSegment`, or None); `is_cut`: the text is
    already known to be more than one segment (a text that fits whole is one segment, its spaces kept).

        >>> stream = SegmentStream(12)
        >>> stream.push("One. Two, thr"), stream.push("ee. Four five six."), stream.finish()
        (['One. '], ['Two, three. ', 'Four five '], ['six.'])
    """

    def __init__(self, max_size: int, size: Callable[[str], int] = len):
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size must be an integer >= 1, got {max_size!r}")
        self.max_size = max_size
        self.size = size
        self.text = ""
        self.is_finished = False
        self.is_cut = False
        self.open: OpenSegment | None = None
        self._num_final = 0  # segments handed out

    def push(self, text: str) -> list[str]:
        """More text → the segments that became final."""
        if self.is_finished:
            raise ValueError("text: the text is already finished")
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        self.text += text
        return self._take(is_open=True)

    def finish(self) -> list[str]:
        """The end of the text → its remaining segments."""
        if self.is_finished:
            raise ValueError("text: the text is already finished")
        self.is_finished = True
        return self._take(is_open=False)

    def _take(self, is_open: bool) -> list[str]:
        # Cut from the start each time: a segment's cut depends on the pieces before it at every level.
        parts = list(_split(self.text, 0, self.max_size, self.size, is_open)) if self.text else []
        self.open = parts.pop() if parts and isinstance(parts[-1], OpenSegment) else None
        final = parts[self._num_final:]
        self._num_final = len(parts)
        self.is_cut = self.is_cut or len(parts) > 1 or bool(parts and self.open) or (
            is_open and self.size(self.text) > self.max_size)
        return final


def _pieces(text: str, level: int) -> list[str]:
    """`text` cut after each of the level's marks (characters past the last level). A cut needs the character
    after its mark and spaces, so later text never moves one: only the last piece may still grow."""
    if level == len(_LEVELS):
        return list(text)
    cuts = [match.end() for match in _LEVELS[level].finditer(text) if 0 < match.end() < len(text)]
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[start:end] for start, end in itertools.pairwise(bounds) if end > start]

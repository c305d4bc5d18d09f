"""The words of a transcript, as Qwen3-ForcedAligner gives them time slots (the reference's
`Qwen3ForceAlignProcessor`): each word keeps its letters, digits and apostrophes, a word left empty is dropped.

- languages written with spaces, and Chinese (`split_words`): the space-separated pieces, each CJK ideograph a
  word of its own (Chinese gets character timestamps);
- Japanese (`japanese_words`): nagisa's words;
- Korean (`korean_words`): soynlp's `LTokenizer` scored by the reference's word list
  (`omnimtp/data/korean_words/`, a word a line with score 1).

nagisa and soynlp are the optional extra `omnimtp[cjk]`, imported at the first Japanese or Korean text (nagisa
loads its tagger in about two seconds). A text whose language is not given is split by its script
(`script_language`): kana make it Japanese, Hangul Korean.

    >>> split_words("Hello, world! 你好abc")
    ['Hello', 'world', '你', '好', 'abc']
"""

from __future__ import annotations

import functools
import threading
import unicodedata
from pathlib import Path

# Languages whose words the reference finds with a dictionary tokenizer (nagisa, soynlp) rather than spaces.
DICTIONARY_LANGUAGES = ("Japanese", "Korean")
KOREAN_WORDS = Path(__file__).resolve().parent.parent / "data" / "korean_words" / "korean_dict_jieba.dict"
CJK_EXTRA = "pip install 'omnimtp[cjk]'"

_TAGGING = threading.Lock()  # nagisa's tagger (a DyNet model) is one per process


def is_cjk(char: str) -> bool:
    """A CJK ideograph (the unified blocks, extensions A–E and the compatibility block): a slot of its own."""
    code = ord(char)
    return (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2CEAF
            or 0xF900 <= code <= 0xFAFF)


def _is_kept(char: str) -> bool:
    return char == "'" or unicodedata.category(char)[0] in "LN"


def _cleaned(pieces) -> list[str]:
    """Each piece's letters, digits and apostrophes; the pieces left empty dropped."""
    return [kept for kept in ("".join(char for char in piece if _is_kept(char)) for piece in pieces) if kept]


def split_words(text: str) -> list[str]:
    """The transcript's alignment units for a language written with spaces (and Chinese): each space-separated
    piece keeps its letters, digits and apostrophes, and each CJK ideograph in it is a unit of its own."""
    words = []
    for kept in _cleaned(text.split()):
        run = ""
        for char in kept:
            if is_cjk(char):
                if run:
                    words.append(run)
                words.append(char)
                run = ""
            else:
                run += char
        if run:
            words.append(run)
    return words


def japanese_words(text: str) -> list[str]:
    """Japanese words as nagisa tags them, cleaned. ValueError naming language without nagisa."""
    nagisa = _optional("nagisa", "Japanese")
    with _TAGGING:
        return _cleaned(nagisa.tagging(text).words)


def korean_words(text: str) -> list[str]:
    """Korean words as soynlp's `LTokenizer` with the reference's word list splits them, cleaned. ValueError
    naming language without soynlp."""
    return _cleaned(_korean_tokenizer().tokenize(text))


@functools.cache
def _korean_tokenizer():
    tokenizer = _optional("soynlp.tokenizer", "Korean")
    with open(KOREAN_WORDS, encoding="utf-8") as f:
        scores = {line.split()[0]: 1.0 for line in f if line.strip()}
    return tokenizer.LTokenizer(scores=scores)


def _optional(module: str, language: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"language: {language} words are split with {module.split('.')[0]}, which is not "
                         f"installed ({CJK_EXTRA})") from None


def script_language(text: str) -> str | None:
    """"Japanese" for a text with kana, "Korean" for one with Hangul, else None (split at spaces)."""
    for char in text:
        code = ord(char)
        if 0x3040 <= code <= 0x30FF or 0x31F0 <= code <= 0x31FF or 0xFF66 <= code <= 0xFF9D:
            return "Japanese"
        if 0xAC00 <= code <= 0xD7A3 or 0x1100 <= code <= 0x11FF or 0x3130 <= code <= 0x318F:
            return "Korean"
    return None


def words_of(text: str, language: str | None) -> list[str]:
    """The alignment units of `text` in `language` (a released language name, or None: by its script)."""
    language = language or script_language(text)
    if language == "Japanese":
        return japanese_words(text)
    if language == "Korean":
        return korean_words(text)
    return split_words(text)

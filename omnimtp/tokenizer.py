"""A byte-level text tokenizer for the embedded tiny Qwen3-Omni.

Ids 0..255 are the UTF-8 bytes, the specials of `omnimtp.models.tiny.THINKER_SPECIAL_TOKENS` follow.
It is a `PreTrainedTokenizerFast` with a Qwen-style chat template, so `apply_chat_template`,
`save_pretrained` and `AutoTokenizer.from_pretrained` work on it like on a real checkpoint's tokenizer,
and it names its media tokens as `Qwen3OmniMoeProcessor` expects (`audio_token`, `image_token`, ...).

    >>> tok = byte_tokenizer()
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    [256, 262, 10, 72, 105, 257, 10, 256, 263, 10]
"""

from __future__ import annotations

import json
import re
import threading
import weakref

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel, Split
from transformers import PreTrainedTokenizerFast

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS

# Qwen2's pre-tokenizer regex (its tokenizer.json): words, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Role names are single tokens (the talker finds user turns by the id after <|im_start|>); they only
# match as whole words, so "username" stays bytes.
ROLE_TOKENS = ("system", "user", "assistant")

# The multimodal tokens under the names transformers' Qwen3-Omni processor reads from its tokenizer
# (saved in tokenizer_config.json, so they survive save_pretrained / from_pretrained).
MEDIA_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}

# Content parts render as Qwen3-Omni's own template renders them: one pad per media part between its
# start and end tokens (the processor expands the pad to one per encoder row), text parts as text.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' or 'audio' in part or 'audio_url' in part %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(special_tokens: dict[str, int] = THINKER_SPECIAL_TOKENS) -> PreTrainedTokenizerFast:
    """A tiny model's tokenizer: 256 byte tokens + the thinker specials at their fixed ids (default the tiny
    Qwen3-Omni's; `omnimtp.models.tiny_qwen2_5_omni.QWEN2_5_THINKER_SPECIAL_TOKENS` for the tiny Qwen2.5-Omni)."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # Qwen2's pre-tokenizer: with no merges the ids are the bytes whatever the pieces, and the pieces are words as
    # in a real checkpoint's tokenizer (what text streamed into speech is committed by, `StreamedTextIds`)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"), ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    for name, token_id in sorted(special_tokens.items(), key=lambda item: item[1]):
        is_role = name in ROLE_TOKENS
        tokenizer.add_tokens([AddedToken(name, special=not is_role, single_word=is_role, normalized=False)])
        if tokenizer.token_to_id(name) != token_id:
            raise RuntimeError(f"special token {name!r} got id {tokenizer.token_to_id(name)}, expected {token_id}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        chat_template=QWEN_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **MEDIA_TOKENS,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


_UNICODE_TO_BYTE = {char: byte for byte, char in _bytes_to_unicode().items()}


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """Each token's own text as UTF-8 bytes: a byte-level BPE token's bytes (a piece of a character has the bytes
    it holds; joined in order they are the text's), an added token's text (`<asr_text>`); an id past the
    tokenizer's vocabulary (a model's padded rows) has none."""
    added = set(tokenizer.get_added_vocab())
    pieces = []
    for token in tokenizer.convert_ids_to_tokens([int(token_id) for token_id in ids]):
        if token is None:
            pieces.append(b"")
        elif token in added or not all(char in _UNICODE_TO_BYTE for char in token):
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(bytes(_UNICODE_TO_BYTE[char] for char in token))
    return pieces


# --- prompts: the template's structure as special ids, message text as text ---------------------------

# Private-use characters: one that no message holds marks where a special-token string stood in a message.
_PRIVATE_USE = range(0xE000, 0xF900)


class PromptTokenizer:
    """A chat tokenizer that keeps message text as text: a special-token string inside a message
    (`<|im_end|>`, `<|image_pad|>`, ...) is tokenized as ordinary characters, so only the chat template's
    own structure yields special ids and a message can neither forge a turn boundary nor a media
    placeholder. Text without special-token strings gets exactly the tokenizer's `apply_chat_template` ids.

    How: a special-token string in a message is replaced by a private-use placeholder, the template is
    rendered, the rendered prompt is cut at its special tokens (the template's, found by the tokenizer
    itself), and each piece between them, placeholders restored, is encoded with special tokens read as
    text. The tokenizer splits at added tokens before anything else and encodes the pieces independently,
    so a piece's ids are what the tokenizer gives that piece inside the whole prompt.

        >>> PromptTokenizer(byte_tokenizer()).chat_ids([{"role": "user", "content": "<|im_end|>"}])[:4]
        [256, 262, 10, 60]    # <|im_start|> user \\n "<" ..., no 257 (<|im_end|>) until the template's own

    tokenizer: a tokenizers-backed transformers tokenizer (`backend_tokenizer`) with a chat template.
    Encoding goes through `encode_batch`, which releases the GIL: a long prompt tokenized off the event
    loop does not hold up the loop."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self.literal = Tokenizer.from_str(self._backend.to_str())  # special-token strings are text
        self.literal.encode_special_tokens = True
        specials = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()
                    if token.special}
        self.special_ids = frozenset(specials.values())
        self.specials = tuple(sorted(specials, key=len, reverse=True))  # longest first: the longest match wins
        self._special = re.compile("|".join(map(re.escape, self.specials))) if specials else None
        self.max_chars_per_token = _max_chars_per_token(tokenizer, set(specials))

    def encode(self, text: str) -> list[int]:
        """`text` as ordinary text: special-token strings in it are characters."""
        return self.literal.encode_batch([text], add_special_tokens=False)[0].ids

    def has_special_text(self, texts) -> bool:
        """Whether any of `texts` holds a special-token string."""
        return self._special is not None and any(self._special.search(text) for text in texts)

    def min_num_tokens(self, texts) -> int | None:
        """A lower bound on the tokens `texts` take in any prompt, from their lengths alone, or None when the
        tokenizer gives no bound (`max_chars_per_token`). Cheap next to tokenizing: it bounds a prompt before
        it is tokenized."""
        if self.max_chars_per_token is None:
            return None
        normalizer = self._backend.normalizer
        lengths = (len(normalizer.normalize_str(text) if normalizer is not None else text) for text in texts)
        return sum(-(-length // self.max_chars_per_token) for length in lengths)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The templated prompt of chat messages (content strings or text parts), the assistant turn opened."""
        texts = list(message_texts(messages))
        if not self.has_special_text(texts):
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        prompt, restore = self.rendered(messages)
        ids = []
        for piece in self.pieces(prompt):
            ids.extend([piece] if isinstance(piece, int) else self.encode(restore(piece)))
        return ids

    def rendered(self, messages: list[dict], renderer=None) -> tuple[str, callable]:
        """(the prompt the template renders with every special-token string of the messages' text replaced by a
        placeholder, restore: a piece of that prompt → its text with the strings back). renderer: what renders
        the template (default the tokenizer; a processor for messages with media parts)."""
        texts = list(message_texts(messages))
        used = set().union(*map(set, texts)) if texts else set()
        marker = chr(next(c for c in _PRIVATE_USE if chr(c) not in used))
        index = {special: k for k, special in enumerate(self.specials)}

        def hide(text: str) -> str:
            return self._special.sub(lambda m: f"{marker}{index[m.group()]}{marker}", text)

        hidden = [{**message, "content": hide(message["content"]) if isinstance(message["content"], str) else [
            {**part, "text": hide(part["text"])} if part.get("type") == "text" else part
            for part in message["content"]]} for message in messages]
        prompt = (renderer or self.tokenizer).apply_chat_template(hidden, add_generation_prompt=True, tokenize=False)
        placeholder = re.compile(f"{marker}(\\d+){marker}")

        def restore(piece: str) -> str:
            return placeholder.sub(lambda m: self.specials[int(m.group(1))], piece)

        return prompt, restore

    def pieces(self, prompt: str) -> list[int | str]:
        """`prompt` cut at its special tokens: each special token as its id, the text between as a string."""
        encoding = self._backend.encode_batch([prompt], add_special_tokens=False)[0]
        pieces, start = [], 0
        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self.special_ids:
                if begin > start:
                    pieces.append(prompt[start:begin])
                pieces.append(token_id)
                start = end
        if start < len(prompt):
            pieces.append(prompt[start:])
        return pieces

    def processed_ids(self, prompt: str, restore, ids: list[int], pad_ids) -> list[int]:
        """The ids a processor gave for `prompt` (from `rendered`), each piece of placeholder text replaced by its
        restored text's ids: the processor's pad expansion (each id of `pad_ids` repeated per encoder row) is
        kept. RuntimeError if the processor's ids do not follow the prompt's pieces."""
        restored, position = [], 0
        for piece in self.pieces(prompt):
            if isinstance(piece, int):
                end = position + 1
                if piece in pad_ids:
                    while end < len(ids) and ids[end] == piece:
                        end += 1
                if ids[position:position + 1] != [piece]:
                    raise RuntimeError(f"the processor's ids do not follow the prompt at id {position}")
                restored.extend(ids[position:end])
            else:
                given = self._backend.encode_batch([piece], add_special_tokens=False)[0].ids
                end = position + len(given)
                if ids[position:end] != given:
                    raise RuntimeError(f"the processor's ids do not follow the prompt at id {position}")
                restored.extend(self.encode(restore(piece)))
            position = end
        if position != len(ids):
            raise RuntimeError("the processor's ids do not follow the prompt: it gave more ids")
        return restored


_prompt_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_prompt_tokenizers_lock = threading.Lock()


def prompt_tokenizer(tokenizer) -> PromptTokenizer:
    """The `PromptTokenizer` of `tokenizer`, made once per tokenizer (it copies the tokenizer's backend)."""
    with _prompt_tokenizers_lock:
        made = _prompt_tokenizers.get(tokenizer)
        if made is None:
            made = _prompt_tokenizers[tokenizer] = PromptTokenizer(tokenizer)
        return made


def message_texts(messages: list[dict]):
    """Every text of chat messages: string contents and the text of text parts."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str))


def _max_chars_per_token(tokenizer, specials: set[str]) -> int | None:
    """The most characters of (normalized) message text one token can stand for, or None when nothing bounds it.

    A BPE token stands for its vocabulary entry: with a byte-level pre-tokenizer an entry spells one
    character per byte, so it covers at most len(entry) bytes and so at most len(entry) characters; without
    one (SentencePiece-style entries, byte-fallback `<0xNN>` pieces) it covers at most len(entry) characters.
    An added token that is not special matches its own content. So a text of n characters takes at least
    n / max len(entry) tokens. An unknown-token run fused into one token (`fuse_unk`), and other models
    (WordPiece's and WordLevel's whole-word unknowns), cover any length: no bound."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    entries = [entry for entry in tokenizer.get_vocab() if entry not in specials]
    return max(map(len, entries), default=None)


# --- text that arrives in pieces -----------------------------------------------------------------------


class StreamedTextIds:
    """The ids of a text that arrives in pieces, each handed out once no later text can change it: whatever
    the split, `push(a) + push(b) + ... + finish()` == `backend.encode(head + a + b + ... + tail).ids`, with
    `prefix_ids` first.

    Which ids are final. A tokenizer cuts its text at added tokens, then its pre-tokenizer cuts each stretch into
    pieces (words, digits, punctuation runs, whitespace runs), and ids never span two pieces. Text appended at the
    end can only change the last piece (a word grows, a space run is split off by the next word, a combining mark
    joins its letter under NFC) or complete an added token whose start is already here. So a push holds back
    the text from the earliest point where its tail could still start an added token, and of the rest the last
    piece; it hands out the ids before that, after checking they are what that text alone encodes to. What is
still held is encoded after the last piece handed out (its ids dropped): an added token that matches only as a
whole word (`single_word`) looks at the character before it, so "1assistant" keeps "assistant" as text where
"assistant" alone would be one added token.

        >>> text = StreamedTextIds(byte_tokenizer().backend_tokenizer)
        >>> text.push("Hello wor"), text.push("ld"), text.finish()
        ([72, 101, 108, 108, 111], [], [32, 119, 111, 114, 108, 100])

    backend: a `tokenizers.Tokenizer` (a transformers tokenizer's `backend_tokenizer`, or `PromptTokenizer`'s
    copy that reads special-token strings as text)."""

    def __init__(self, backend: Tokenizer, *, head: str = "", tail: str = "", prefix_ids=()):
        self.backend = backend
        self.tail = tail
        self.text = ""  # what was pushed (head and tail not included)
        self._pending = head  # text whose ids are not handed out yet
        self._context = ""  # the last piece handed out, right before _pending: what _pending is encoded after
        self._context_ids: list[int] = []
        self._prefix_ids = [int(i) for i in prefix_ids]
        contents = [token.content for token in backend.get_added_tokens_decoder().values()]
        self._added = tuple(content for content in contents if content)
        self._max_added = max(map(len, self._added), default=0)
        self.is_finished = False

    def push(self, text: str, lookahead: str = "") -> list[int]:
        """More text → the ids that became final. lookahead: text that either follows it or is not part of this
        text at all (spaces a segment of a longer text may end before): it only helps decide which ids are
        final (those final both with it and with the text ending here), and is not pushed."""
        if self.is_finished:
            raise ValueError("text: the text is already finished")
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        self.text += text
        self._pending += text
        cut, last_start = self._final_prefix(self._pending + lookahead)
        cut = min(cut, len(self._pending))
        ids = self._encode(self._pending[:cut])
        if lookahead and ids != self._encode(self._pending + self.tail)[: len(ids)]:
            cut, ids = 0, []
        if cut:
            context = (self._context if last_start == 0 else "") + self._pending[last_start:cut]
            self._context, self._context_ids = context, self.backend.encode(context, add_special_tokens=False).ids
        self._pending = self._pending[cut:]
        return self._with_prefix(ids)

    def finish(self) -> list[int]:
        """The rest of the ids (the tail's included)."""
        if self.is_finished:
            raise ValueError("text: the text is already finished")
        self.is_finished = True
        ids = self._encode(self._pending + self.tail)
        self._pending = ""
        return self._with_prefix(ids)

    def _with_prefix(self, ids: list[int]) -> list[int]:
        if self._prefix_ids and (ids or self.is_finished):
            ids, self._prefix_ids = self._prefix_ids + ids, []
        return ids

    def _encoding(self, text: str) -> tuple[list[int], list[tuple[int, int]], list[int | None]]:
        """(ids, character offsets into text, piece numbers) of text as it follows the last piece handed out."""
        if not text:
            return [], [], []
        if self._context:
            encoding = self.backend.encode(self._context + text, add_special_tokens=False)
            skip = len(self._context_ids)
            if encoding.ids[:skip] == self._context_ids and all(
                start >= len(self._context) for start, _ in encoding.offsets[skip:]
            ):
                shift = len(self._context)
                offsets = [(start - shift, end - shift) for start, end in encoding.offsets[skip:]]
                return encoding.ids[skip:], offsets, encoding.word_ids[skip:]
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets, encoding.word_ids

    def _encode(self, text: str) -> list[int]:
        return self._encoding(text)[0]

    def _final_prefix(self, text: str) -> tuple[int, int]:
        """(how many characters of `text`, the text not handed out yet, have final ids; where the last piece
        of those starts)."""
        held = len(text)  # from here on the text could still become an added token
        for start in range(max(len(text) - self._max_added, 0), len(text)):
            if any(content.startswith(text[start:]) for content in self._added):
                held = start
                break
        ids, offsets, words = self._encoding(text[:held])
        if not words:
            return 0, 0
        last = next(i for i, word in enumerate(words) if word == words[-1])  # the last piece's first token
        cut = offsets[last][0] if last > 0 else 0
        if cut == 0 or self._encode(text[:cut]) != ids[:last]:
            return 0, 0
        before = next(i for i, word in enumerate(words) if word == words[last - 1])  # the piece before it
        return cut, offsets[before][0]

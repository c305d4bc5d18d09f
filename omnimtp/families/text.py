"""Text helpers every family shares: the chat template, the opened assistant turn, speaker names."""

from __future__ import annotations

from collections.abc import Iterator

from omnimtp.media import MediaInputs, MediaLimits, chat_media_inputs, has_media
from omnimtp.text_segments import SegmentStream, iter_segments
from omnimtp.tokenizer import StreamedTextIds, prompt_tokenizer

# The most ids one character takes (a byte-level tokenizer's UTF-8 bytes): a segment's window must hold them.
MAX_IDS_PER_CHARACTER = 4


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The templated prompt of chat messages, the assistant turn opened; message text stays text (a special-token
    string in it is characters, `omnimtp.tokenizer.PromptTokenizer`)."""
    if not has_chat_template(tokenizer):
        raise ValueError("prompt: this checkpoint's tokenizer has no chat template; pass input_ids")
    return prompt_tokenizer(tokenizer).chat_ids(messages)


def speech_header_ids(tokenizer) -> list[int] | None:
    """The ids that open an assistant turn after a user turn (what a speech request's text follows), or None
    without a chat template. ValueError when the template does not open one."""
    if not has_chat_template(tokenizer):
        return None
    probe = [{"role": "user", "content": "x"}]
    opened = list(tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True, return_dict=False))
    closed = list(tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=True, return_dict=False))
    if opened[: len(closed)] != closed or len(opened) == len(closed):
        raise ValueError("tokenizer: its chat template does not open an assistant turn after the prompt")
    return opened[len(closed):]


# The speech input languages of Qwen3-Omni's model card, by ISO-639-1 code (what OpenAI's `language` takes).
TRANSCRIPTION_LANGUAGES = {
    "en": "English", "zh": "Chinese", "ko": "Korean", "ja": "Japanese", "de": "German", "ru": "Russian",
    "it": "Italian", "fr": "French", "es": "Spanish", "pt": "Portuguese", "ms": "Malay", "nl": "Dutch",
    "id": "Indonesian", "tr": "Turkish", "vi": "Vietnamese", "yue": "Cantonese", "ar": "Arabic", "ur": "Urdu",
}


def transcription_language(language: str | None) -> str | None:
    """An ISO-639-1 code or an English language name → the name the ASR prompt says; None stays None."""
    if language is None:
        return None
    if not isinstance(language, str) or not language.strip():
        raise ValueError(f"language: expected a language code such as 'en', got {language!r}")
    key = language.strip().lower()
    if key in TRANSCRIPTION_LANGUAGES:
        return TRANSCRIPTION_LANGUAGES[key]
    name = next((name for name in TRANSCRIPTION_LANGUAGES.values() if name.lower() == key), None)
    if name is None:
        raise ValueError(f"language: {language!r} is not a speech input language of the model; one of "
                         f"{sorted(TRANSCRIPTION_LANGUAGES)}")
    return name


def match_speaker(speakers, name: str) -> str | None:
    """The speaker of `speakers` called `name` (case-insensitive), or None."""
    lowered = name.strip().lower()
    return next((speaker for speaker in speakers if speaker.lower() == lowered), None)


class ChatText:
    """A family's prompt ids and reply text, the same for every family: it has `tokenizer` (or None: requests
    come as token ids and no text is decoded), `processor` (or None: media parts are refused),
    `speech_header_ids` (`speech_header_ids(tokenizer)`) and `speakers`; has_chat: whether it answers chat
    prompts (a thinker), False for a speech-only model."""

    has_chat = True
    speaks = True  # it has a talker (a model that only hears, Qwen3-ASR, has not)
    tokenizer = None
    processor = None
    speech_header_ids: list[int] | None = None
    speakers: tuple[str, ...] = ()

    # The ASR prompt of Qwen3-Omni's cookbook (speech_recognition.ipynb; its README's evaluation prompt
    # "Transcribe the <source_language> audio into text."); a family whose cookbook adds a system line sets it.
    transcription_system: str | None = None

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The templated prompt of chat messages, the assistant turn opened."""
        return chat_ids(self.tokenizer, messages)

    def transcription_language(self, language: str | None) -> str | None:
        """An ISO-639-1 code or a language name → the English name the ASR prompt says (`transcription_language`)."""
        return transcription_language(language)

    def transcription_messages(self, audio, language: str | None = None, prompt: str | None = None) -> list[dict]:
        """The chat messages that ask the thinker to transcribe `audio` (a chat audio part's value): a user turn
        of the audio and "Transcribe the {language} audio into text." ("Transcribe the audio into text." without
        a language). prompt (context, e.g. the previous words or spellings) goes into the system turn, after
        the family's own system line if it has one."""
        name = transcription_language(language)
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string, got {type(prompt).__name__}")
        instruction = f"Transcribe the {name} audio into text." if name else "Transcribe the audio into text."
        system = "\n".join(text for text in (self.transcription_system, (prompt or "").strip()) if text)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": [{"type": "audio", "audio": audio},
                                                     {"type": "text", "text": instruction}]})
        return messages

    def transcription_inputs(self, samples, language: str | None = None, prompt: str | None = None,
                             limits: MediaLimits | None = None) -> tuple[list[int], MediaInputs | None]:
        """The prompt ids and media tensors that ask the model to transcribe `samples` (16 kHz float): the chat
        inputs of `transcription_messages`."""
        return self.chat_inputs(self.transcription_messages(samples, language, prompt), limits or MediaLimits())

    def parse_transcript(self, reply: str, language: str | None = None) -> tuple[str | None, str]:
        """A transcription reply → (language, text): the thinker writes the text alone, so the language is the
        hint given, by its English name ("en" → "English"), or None."""
        return self.transcription_language(language), reply.strip()

    def transcript_deltas(self, language: str | None = None) -> TranscriptDeltas:
        """The text deltas of a transcription reply as it is written (`TranscriptDeltas`): here the reply's own."""
        return TranscriptDeltas()

    def chat_inputs(self, messages: list[dict], limits: MediaLimits) -> tuple[list[int], MediaInputs | None]:
        """The templated prompt of chat messages and their media tensors (`omnimtp.media.chat_media_inputs`);
        text-only messages give `chat_ids` and None."""
        if not has_media(messages):
            return self.chat_ids(messages), None
        return chat_media_inputs(self.processor, messages, limits)

    def speech_ids(self, text: str) -> list[int]:
        """An opened assistant turn followed by `text` (as text: special-token strings are characters): what a
        speech request's talker speaks."""
        if self.speech_header_ids is None:
            raise ValueError("input: this checkpoint's tokenizer has no chat template to open an assistant turn")
        return self.speech_header_ids + prompt_tokenizer(self.tokenizer).encode(text)

    def num_speech_template_ids(self) -> int:
        """The ids `speech_ids` puts around a text (here the opened assistant turn)."""
        if self.speech_header_ids is None:
            raise ValueError("input: this checkpoint's tokenizer has no chat template to open an assistant turn")
        return len(self.speech_header_ids)

    def speech_window(self, speaker, max_frames: int) -> int | None:
        """The most `speech_ids` one segment spoken by `speaker` with up to max_frames frames may have so that
        the talker's positions hold it, or None where only the text budget counts."""
        return None

    def speech_segments(self, text: str, speaker, max_frames: int, max_segment_tokens: int) -> Iterator[list[int]]:
        """The `speech_ids` of `text` cut into segments the talker speaks one after another (one request: the
        same voice, generators and codec stream): each segment at most max_segment_tokens text tokens and
        within `speech_window`, cut at sentence ends, then clause marks, then between words
        (`omnimtp.text_segments.iter_segments`), each without the spaces around it. A text that fits is one
        segment, `speech_ids(text)`. The segments are cut as they are asked for, so the first is ready about as
        soon as a short text's. ValueError naming max_frames (at once) when the talker's positions beside
        max_frames frames leave no room for a character's ids."""
        max_ids = self.max_segment_ids(speaker, max_frames, max_segment_tokens)
        ids = self.speech_ids(text)
        if len(ids) <= max_ids:
            return iter([ids])

        def size(piece: str) -> int:
            if piece is text:
                return len(ids)  # known: the whole text is tokenized once
            return len(self.speech_ids(piece.strip())) if piece.strip() else 0

        return (self.speech_ids(piece.strip()) for piece in iter_segments(text, max_ids, size) if piece.strip())

    def max_segment_ids(self, speaker, max_frames: int, max_segment_tokens: int) -> int:
        """The most `speech_ids` one segment of a spoken text may have (see `speech_segments`); ValueError naming
        max_frames when the talker's positions beside max_frames frames leave no room for a character's ids."""
        num_template = self.num_speech_template_ids()
        max_ids = num_template + max_segment_tokens
        window = self.speech_window(speaker, max_frames)
        if window is not None:
            if window < num_template + MAX_IDS_PER_CHARACTER:
                raise ValueError(f"max_frames: {max_frames} frames leave the talker's {self.max_positions} "
                                 "positions no room for text")
            max_ids = min(max_ids, window)
        return max_ids

    def streamed_speech_segments(self, speaker, max_frames: int, max_segment_tokens: int) -> StreamedSpeechSegments:
        """`speech_segments` of a text that arrives in pieces (`StreamedSpeechSegments`); ValueError as it."""
        return StreamedSpeechSegments(self, self.max_segment_ids(speaker, max_frames, max_segment_tokens))

    def speech_text_ids(self) -> StreamedTextIds:
        """The ids of text to speak that arrives in pieces: joined, `speech_ids` of the whole text."""
        if self.speech_header_ids is None:
            raise ValueError("input: this checkpoint's tokenizer has no chat template to open an assistant turn")
        return StreamedTextIds(prompt_tokenizer(self.tokenizer).literal, prefix_ids=self.speech_header_ids)

    def min_prompt_tokens(self, texts) -> int | None:
        """A lower bound on the prompt tokens of a request whose text is `texts` (chat message texts, or the text
        to speak), from their lengths alone (`PromptTokenizer.min_num_tokens`); None without a tokenizer or a
        bound."""
        if self.tokenizer is None:
            return None
        return prompt_tokenizer(self.tokenizer).min_num_tokens(texts)

    def decode_text(self, ids: list[int]) -> str:
        """Reply ids → text (special tokens skipped); "" without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def match_speaker(self, name: str) -> str | None:
        """The model's speaker called `name` (case-insensitive), or None."""
        return match_speaker(self.speakers, name)


class TranscriptDeltas:
    """The text deltas of a transcription reply as it is written. strips: the deltas join to the reply without
    the spaces around it (what `parse_transcript` gives), else they are the reply's own. holds_tag: the reply
    opens with "language X<asr_text>" (Qwen3-ASR without a forced language), held back until the tag is written
    (a reply that ends without the tag is all text). push(reply delta) → text delta; finish() → what was held
    back."""

    def __init__(self, *, strips: bool = False, holds_tag: bool = False, tag: str = "<asr_text>"):
        self._reply = ""
        self._num_sent = 0
        self._strips = strips or holds_tag
        self._is_open = not holds_tag  # past the tag (or no tag expected)
        self._tag = tag

    def push(self, delta: str) -> str:
        if not self._strips:
            return delta
        self._reply += delta
        if not self._is_open:
            if self._tag not in self._reply:
                return ""
            self._is_open = True
            self._reply = self._reply.split(self._tag, 1)[1]
        return self._take(self._reply.strip())

    def finish(self) -> str:
        if not self._strips:
            return ""
        self._is_open = True
        return self._take(self._reply.strip())

    @property
    def held_tag(self) -> str | None:
        """The tag the reply opens with, which is not the transcript's, until it is written (None: no tag is
        expected, or it has been written)."""
        return None if self._is_open else self._tag

    def _take(self, text: str) -> str:
        if len(text) <= self._num_sent:
            return ""
        delta, self._num_sent = text[self._num_sent:], len(text)
        return delta


class TranscriptTokens:
    """The transcript's tokens of a transcription reply as it is written, for their logprobs: push(items) → the
    items that are the transcript's; finish() → those held back. An item is anything with `bytes` (the token's
    UTF-8 bytes, a list of ints, OpenAI's logprob shape). tag: what the reply opens with that is not the transcript
    (`TranscriptDeltas.held_tag`): the tokens up to the one that ends it are left out (a reply that never writes it
    is all transcript), so the tokens kept are those of the text after the tag."""

    def __init__(self, tag: str | None = None):
        self._tag = None if tag is None else tag.encode("utf-8")
        self._held: list = []

    def push(self, items: list) -> list:
        if self._tag is None:
            return list(items)
        self._held += items
        head = b"".join(bytes(item["bytes"]) for item in self._held)
        at = head.find(self._tag)
        if at < 0:
            return []
        end, num_bytes, kept = at + len(self._tag), 0, []
        for item in self._held:
            num_bytes += len(item["bytes"])
            if num_bytes > end:
                kept.append(item)
        self._tag, self._held = None, []
        return kept

    def finish(self) -> list:
        held, self._held, self._tag = self._held, [], None
        return held


class StreamedSpeechSegments:
    """`ChatText.speech_segments` of a text that arrives in pieces, as the ids to speak while it comes:
    `push(text)` and `finish()` give (ids, ends_segment) pairs for `EngineCore.push_speech_ids`; joined segment
    by segment they are the whole text's `speech_segments`, however the text was split.

    The text is cut by the one rule (`omnimtp.text_segments.SegmentStream`): a segment is final once its end is
    certain, and the ids of the segment being written go out as far as its text is surely in it
    (`OpenSegment.num_certain`: the sentences, clauses or words before the one still being written) and no
    later text can change them (`omnimtp.tokenizer.StreamedTextIds`). So a segment's first sentence goes on a
    word behind the text, a later sentence once its end shows that it fits the segment, and a long text is
    spoken segment after segment before it is complete. Until the text is known to be cut, a first segment
    that starts with spaces waits (a text that fits whole is spoken with its spaces, a cut one without)."""

    def __init__(self, chat_text: ChatText, max_ids: int):
        self._chat_text = chat_text
        self._sizes: dict[tuple[str, bool], int] = {}
        self._segments = SegmentStream(max_ids, self._size)
        self._ids = chat_text.speech_text_ids()
        self._num_fed = 0  # characters of the open segment's spoken text that went to _ids

    @property
    def text(self) -> str:
        """The text pushed so far."""
        return self._segments.text

    def push(self, text: str) -> list[tuple[list[int], bool]]:
        return self._take(self._segments.push(text))

    def finish(self) -> list[tuple[list[int], bool]]:
        segments = self._segments.finish()
        if self._segments.is_cut or not segments:
            return self._take(segments)
        [whole] = segments  # one segment: the text as `speech_ids` gives it, spaces and all
        return [(self._ids.push(whole[self._num_fed:]) + self._ids.finish(), True)]

    def _size(self, piece: str) -> int:
        """`speech_segments`' size: the whole text's ids, a piece's without the spaces around it."""
        is_whole = piece is self._segments.text
        key = (piece, is_whole)
        if key not in self._sizes:
            spoken = piece if is_whole else piece.strip()
            self._sizes[key] = len(self._chat_text.speech_ids(spoken)) if spoken.strip() else 0
        return self._sizes[key]

    def _take(self, segments: list[str]) -> list[tuple[list[int], bool]]:
        taken = []
        for segment in segments:
            spoken = segment.strip()
            if spoken:
                taken.append((self._ids.push(spoken[self._num_fed:]) + self._ids.finish(), True))
            self._ids, self._num_fed = self._chat_text.speech_text_ids(), 0
        open_segment = self._segments.open
        if open_segment is None:
            return taken
        certain = open_segment.text[: open_segment.num_certain]
        if self._segments.is_cut:
            spoken = certain.strip()
        else:  # it may be the whole text (spoken with its spaces) or a first segment (without)
            spoken = "" if open_segment.text[:1].isspace() else certain.rstrip()
        if len(spoken) > self._num_fed:
            # the spaces after it settle its last word: whether they end the segment or more of it follows
            spaces = certain[len(certain.rstrip()):] if spoken else ""
            ids = self._ids.push(spoken[self._num_fed:], lookahead=spaces)
            self._num_fed = len(spoken)
            if ids:
                taken.append((ids, False))
        return taken

"""What the command line shares besides its parsers: model text made safe for a terminal, library warnings
that say nothing to a user of these models kept out of the way, and Ctrl-C / SIGTERM as an exception that
unwinds the main thread (files closed, Ray shut down) instead of a process killed mid-write."""

from __future__ import annotations

import contextlib
import logging
import os
import signal

# transformers' rope validation does not know the M-RoPE keys that Qwen-Omni configs carry (its rope
# functions read them): the warning it logs for them is expected.
_ROPE_LOGGER = "transformers.modeling_rope_utils"
_ROPE_MESSAGE = "Unrecognized keys in `rope_parameters`"
_MROPE_KEYS = ("'mrope_section'", "'interleaved'")


def printable(text: str) -> str:
    """`text` with every character a terminal would act on or hide escaped (`\\x05`, `\\x7f`, `\\x1b`,
    `\\u200b`), newlines and tabs kept: random or adversarial model text prints as what it is.

        printable("a\\x05b\\nc") == "a\\\\x05b\\nc"
    """
    if text.isprintable() and "\r" not in text:
        return text
    return "".join(ch if ch.isprintable() or ch in "\n\t" else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class _ExpectedRopeKeys(logging.Filter):
    """Drops transformers' "Unrecognized keys in `rope_parameters`" warning when the keys are only
    Qwen-Omni's M-RoPE ones; any other unknown key is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(_ROPE_MESSAGE):
            return True
        keys = message[message.rfind("{") + 1: message.rfind("}")].split(", ")
        return not set(keys) <= set(_MROPE_KEYS)


_ROPE_FILTER = _ExpectedRopeKeys()

# transformers reads a Qwen3-TTS checkpoint's config.json (model_type "qwen3_tts", a model it does not know)
# when it loads the tokenizer, and warns that the type differs from its generic config's: expected.
_CONFIG_LOGGER = "transformers.configuration_utils"
_QWEN3_TTS_MESSAGE = "You are using a model of type `qwen3_tts` to instantiate a model of type ``."


# Qwen2.5-Omni's talker config carries the thinker's text ids beside its own codec vocabulary: transformers'
# check of every `*_token_id` against the talker's vocabulary warns for each of these, on every load, as expected.
# The same check on any other id (or any other config's out-of-range id) is still reported.
_VOCABULARY_MESSAGE = "must be `None` or an integer within the vocabulary"
_QWEN2_5_TALKER_TEXT_IDS = frozenset({
    "tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id", "vision_start_token_id",
    "vision_end_token_id", "audio_start_token_id", "audio_end_token_id",
})


class _ExpectedConfigWarnings(logging.Filter):
    """Drops the Qwen3-TTS model-type warning and the Qwen2.5-Omni talker's text-id warnings above."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_QWEN3_TTS_MESSAGE):
            return False
        words = message.split(" ", 3)
        return not (message.startswith("Model config: ") and _VOCABULARY_MESSAGE in message
                    and len(words) > 2 and words[2] in _QWEN2_5_TALKER_TEXT_IDS)


_CONFIG_FILTER = _ExpectedConfigWarnings()


def quiet_expected_warnings() -> None:
    """Install the filters above on transformers' loggers (idempotent; transformers need not be imported)."""
    logging.getLogger(_ROPE_LOGGER).addFilter(_ROPE_FILTER)
    logging.getLogger(_CONFIG_LOGGER).addFilter(_CONFIG_FILTER)


def quiet_progress_bars() -> None:
    """transformers' tqdm bars ("Loading weights") off for the command line, which prints its own readable
    lines; HF_HUB_DISABLE_PROGRESS_BARS=0 in the environment keeps them. Call it before transformers (and
    huggingface_hub) are imported: they read the variable once, then."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@contextlib.contextmanager
def progress_bars_off(is_off: bool = True):
    """transformers' tqdm bars ("Loading weights") off inside where `is_off`, then as they were (for a load
    that takes a fraction of a second, such as a shipped demo checkpoint's; a real checkpoint keeps its bar).
    HF_HUB_DISABLE_PROGRESS_BARS=0 in the environment keeps them, as it does on the command line."""
    asked_for = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("0", "false", "no", "off")
    if not is_off or asked_for:
        yield
        return
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            transformers_logging.enable_progress_bar()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is."""


def _raise_terminated(signum, frame):
    raise Terminated


def interrupt_on_signals() -> None:
    """SIGINT raises KeyboardInterrupt and SIGTERM `Terminated` in the main thread. Call it again after a
    library installs its own handlers (`ray.init` does: its SIGTERM handler prints a C++ stack trace)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_terminated)


def stopped_by(exc: KeyboardInterrupt) -> signal.Signals:
    """The signal a KeyboardInterrupt stands for."""
    return signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT


@contextlib.contextmanager
def signals_ignored():
    """SIGINT and SIGTERM ignored inside (cleanup that must finish, e.g. shutting Ray down), then
    `interrupt_on_signals` again."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        interrupt_on_signals()

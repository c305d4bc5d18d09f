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


class _ExpectedQwen3TTSConfig(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_QWEN3_TTS_MESSAGE)


_QWEN3_TTS_FILTER = _ExpectedQwen3TTSConfig()


def quiet_expected_warnings() -> None:
    """Install the filters above on transformers' loggers (idempotent; transformers need not be imported)."""
    logging.getLogger(_ROPE_LOGGER).addFilter(_ROPE_FILTER)
    logging.getLogger(_CONFIG_LOGGER).addFilter(_QWEN3_TTS_FILTER)


def quiet_progress_bars() -> None:
    """transformers' tqdm bars ("Loading weights") off for the command line, which prints its own readable
    lines; HF_HUB_DISABLE_PROGRESS_BARS=0 in the environment keeps them. Call it before transformers (and
    huggingface_hub) are imported: they read the variable once, then."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


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

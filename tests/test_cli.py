"""The command line before any work: help and usage errors without the heavy stack, every flag documented,
model text printed safely, expected library warnings kept quiet."""

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnimtp.cli import build_parser
from omnimtp.console import printable, quiet_expected_warnings

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "fastapi", "ray")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_help_and_usage_errors_import_neither_torch_nor_transformers(tmp_path):
    """Every subcommand's --help, a flag argparse refuses, a --model that is no checkpoint and an API key
    nobody could use (non-ASCII, or an empty $OMNIMTP_API_KEY that must not quietly turn auth off): answered
    from argparse-level modules, so the heavy stack is never imported (what keeps them under a second)."""
    names = sorted(_subcommands(build_parser()))
    code = f"""
import contextlib, io, json, os, sys
from omnimtp.cli import main
runs = [["--help"]] + [[name, "--help"] for name in {names!r}] + [
    ["speak", "--max-frames", "0", "hi", "-o", "x.wav"],
    ["speak", "--model", "/nonexistent", "hi", "-o", "x.wav"],
    ["chat", "--model", "/nonexistent"],
    ["serve", "--model", {str(tmp_path)!r}],
    ["serve", "--api-key", "sekrit-k\u00e9y"],
    ["serve", "--api-key", ""],
]
codes = []
for argv in runs:
    if argv[1:2] == ["--api-key"] and not argv[2]:  # an empty $OMNIMTP_API_KEY, the flag's default
        os.environ["OMNIMTP_API_KEY"] = ""
        argv = argv[:1]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            codes.append(main(argv))
        except SystemExit as exc:
            codes.append(exc.code)
    if argv[1:2] in (["--model"], ["--api-key"]) or argv == ["serve"]:
        codes.append(err.getvalue())
print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    codes = result["codes"]
    assert codes[: len(names) + 1] == [0] * (len(names) + 1)
    assert codes[len(names) + 1] == 2  # argparse's usage error
    speak_code, speak_err, chat_code, chat_err, serve_code, serve_err, *key_results = codes[len(names) + 2:]
    assert speak_code == chat_code == serve_code == 2
    ascii_code, ascii_err, empty_code, empty_err = key_results
    assert ascii_code == empty_code == 2
    assert "--api-key" in ascii_err and "printable ASCII" in ascii_err and "k\u00e9y" not in ascii_err
    assert "--api-key is empty" in empty_err and "OMNIMTP_API_KEY" in empty_err
    assert "--model: '/nonexistent' does not exist" in speak_err and "Traceback" not in speak_err
    assert "--model: '/nonexistent' does not exist" in chat_err
    assert "is not a checkpoint directory (no config.json)" in serve_err


# What no command that runs one model in this process needs: the server stack (only `serve` builds it), Ray
# (`serve --replicas`, `batch`), the OpenAI client (the tests' and the docs'), and decoders of formats it neither
# reads nor writes (PyAV: mp3 / opus / aac output; librosa: never).
SERVER_STACK = ("fastapi", "starlette", "uvicorn", "prometheus_client")
NEVER_NEEDED = ("ray", "openai", "av", "librosa")


def _imported_by(code: str, cwd: Path) -> list[set[str]]:
    """The modules `code` left imported, run in a fresh interpreter: one set per `snapshot()` it calls, then one
    at its end."""
    script = ("import json, sys\nsnapshots = []\ndef snapshot():\n    snapshots.append(sorted(sys.modules))\n"
              + code + "\nsnapshot()\nprint(json.dumps(snapshots))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    return [set(names) for names in json.loads(out.stdout.strip().splitlines()[-1])]


def _packages(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


# What a command on one model never imports: the other families' code (`omnimtp.families.family_class` imports a
# family on first use). The Qwen3-TTS speech tokenizer is built of Qwen3-Omni's code2wav blocks, so a Qwen3-TTS
# model does import Qwen3-Omni's modeling; only a Base model builds the speaker encoder (Qwen2.5-Omni's ECAPA).
QWEN2_5_OMNI = ("omnimtp.families.qwen2_5_omni", "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni")
QWEN3_ASR = ("omnimtp.families.qwen3_asr", "omnimtp.models.qwen3_asr")
QWEN3_TTS = ("omnimtp.families.qwen3_tts", "omnimtp.models.qwen3_tts", "omnimtp.codec.speech_tokenizer")
QWEN3_TTS_BASE = ("omnimtp.models.speaker_encoder",)


def test_each_command_imports_only_what_it_runs(tmp_path):
    """speak and transcribe on a tiny model import torch and transformers but no server, Ray or client stack,
    and no other family's code (speak on the Qwen3-Omni model no Qwen3-TTS, Qwen3-ASR or Qwen2.5-Omni modules;
    speak on a Qwen3-TTS CustomVoice model no Qwen3-ASR or Qwen2.5-Omni ones); serve's app (what `serve` builds
    before uvicorn runs it) imports no Ray, no OpenAI client and no PyAV. Import costs are what a short
    command's start-up is made of (`python -X importtime -m omnimtp.cli ...`)."""
    question = REPO / "examples" / "question.wav"
    omni, tts, speak = _imported_by(f"""
from omnimtp.cli import main
assert main(["speak", "Hi", "-o", "a.wav", "--max-new-tokens", "2", "--max-frames", "2"]) == 0
snapshot()
assert main(["speak", "--model", "tiny-tts", "Hi", "-o", "b.wav", "--max-frames", "2"]) == 0
snapshot()
assert main(["transcribe", {str(question)!r}, "--max-new-tokens", "2"]) == 0
""", tmp_path)
    not_omni, not_tts = set(QWEN3_TTS + QWEN3_ASR + QWEN2_5_OMNI), set(QWEN3_ASR + QWEN2_5_OMNI + QWEN3_TTS_BASE)
    assert omni.isdisjoint(not_omni), sorted(omni & not_omni)
    assert set(QWEN3_TTS) <= tts and tts.isdisjoint(not_tts), sorted(tts & not_tts)
    speak = _packages(speak)
    assert {"torch", "transformers"} <= speak
    assert speak.isdisjoint(SERVER_STACK + NEVER_NEEDED), sorted(speak & set(SERVER_STACK + NEVER_NEEDED))
    (serve,) = _imported_by("""
from omnimtp.cli import build_parser
from omnimtp.server.build import build_app
build_app(build_parser().parse_args(["serve", "--eager", "--max-frames", "2"]))
""", tmp_path)
    serve = _packages(serve)
    assert {"fastapi", "uvicorn"} & serve and serve.isdisjoint(NEVER_NEEDED), sorted(serve & set(NEVER_NEEDED))


def test_each_family_is_registered_under_its_model_type():
    from omnimtp.families import FAMILIES, family_class

    for model_type in FAMILIES:
        assert family_class(model_type).model_type == model_type
    with pytest.raises(ValueError, match="model_type: 'llama'; supported: "):
        family_class("llama")


def test_help_answers_within_a_generous_bound():
    """`omnimtp --help` in a fresh interpreter: argparse-level modules only, a fraction of a second on an idle
    box (benchmarks/RESULTS.md); the bound leaves room for a loaded one and catches a heavy import at once."""
    import time

    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "omnimtp.cli", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    elapsed = time.perf_counter() - started
    assert out.returncode == 0 and "speak" in out.stdout
    assert elapsed < 10, f"omnimtp --help took {elapsed:.1f} s"


def test_every_flag_says_what_it_does_and_shows_its_default():
    parser = build_parser()
    subcommands = _subcommands(parser)
    assert {"speak", "chat", "serve", "batch", "spec", "train-mtp", "gen-distill-data"} <= set(subcommands)
    for name, sub in subcommands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{flag} has no help"
            shown = formatter._expand_help(action)  # what --help prints for it
            if action.default not in (None, False, [], argparse.SUPPRESS):
                assert "default" in shown, f"{flag} does not show its default"
    serve = subcommands["serve"].format_help()
    for text in ("--host HOST", "(default: 127.0.0.1)", "(default: 8000)"):
        assert text in serve
    assert "(default: 1000)" in subcommands["train-mtp"].format_help()  # --steps
    assert "(default: 0.001)" in subcommands["train-mtp"].format_help()  # --lr
    from omnimtp.spec_decode.adaptive import DEFAULT_MAX_DRAFT_TOKENS

    for name in ("speak", "chat", "serve", "spec"):  # -k auto's range, as the controller has it
        (draft,) = [a for a in subcommands[name]._actions if "--num-draft-tokens" in a.option_strings]
        assert f"'auto': 0..{DEFAULT_MAX_DRAFT_TOKENS} a step" in draft.help, name


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable("Hello, wörld 🙂") == "Hello, wörld 🙂"
    assert printable("a\x05b\x7fc\x1b[31md") == "a\\x05b\\x7fc\\x1b[31md"
    assert printable("line\nnext\tcol\rback") == "line\nnext\tcol\\x0dback"
    assert printable("zero\u200bwidth\U000e0001") == "zero\\u200bwidth\\U000e0001"
    text = "raw \x00 bytes"
    printable(text)
    assert text == "raw \x00 bytes"


def _passed(logger: logging.Logger, messages: list[str]) -> list[str]:
    """The messages of `messages`, logged as warnings on `logger`, that its filters let through (seen by a
    handler on the logger itself: once transformers is imported its loggers do not propagate to the root)."""
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        for message in messages:
            logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return seen


def test_only_the_expected_rope_warning_is_quiet():
    quiet_expected_warnings()
    quiet_expected_warnings()  # idempotent
    logger = logging.getLogger("transformers.modeling_rope_utils")
    assert logger.filters.count(logger.filters[0]) == 1 and len(logger.filters) == 1
    yarn = "Unrecognized keys in `rope_parameters` for 'rope_type'='yarn': {'mrope_section', 'factorr'}"
    assert _passed(logger, [
        "Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'mrope_section', 'interleaved'}",
        "Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'mrope_section'}",
        yarn, "something else"]) == [yarn, "something else"]


def test_tiny_model_configs_build_without_the_rope_warning(capfd):
    from omnimtp.models.tiny import tiny_qwen3_omni_config

    quiet_expected_warnings()
    tiny_qwen3_omni_config()
    assert "Unrecognized keys" not in capfd.readouterr().err


def test_only_the_qwen2_5_talkers_text_ids_are_quiet_of_the_vocabulary_warnings(capfd):
    """Qwen2.5-Omni's talker config holds the thinker's text ids, outside its codec vocabulary: transformers'
    warning for those is dropped, the same warning for any other id is not."""
    from omnimtp.models.tiny_qwen2_5_omni import tiny_qwen2_5_omni

    quiet_expected_warnings()
    logger = logging.getLogger("transformers.configuration_utils")
    template = "Model config: {} must be `None` or an integer within the vocabulary (between 0 and 63), got 259."
    names = ("tts_text_start_token_id", "audio_end_token_id", "pad_token_id", "vision_start_token_idx")
    passed = _passed(logger, [template.format(name) for name in names] + ["tts_text_start_token_id: other"])
    assert passed == [template.format("pad_token_id"), template.format("vision_start_token_idx"),
                      "tts_text_start_token_id: other"]
    capfd.readouterr()
    tiny_qwen2_5_omni()
    assert "within the vocabulary" not in capfd.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--port", "x"], ["speak", "--max-new-tokens", "-1", "-o", "a.wav", "hi"]])
def test_a_bad_value_is_a_usage_error_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert f"argument {argv[1]}" in capsys.readouterr().err


def test_version_and_serve_help_list_every_route(capsys):
    from omnimtp import __version__
    from omnimtp.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"omnimtp {__version__}\n"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for route in ("/v1/chat/completions", "/v1/audio/speech,", "/v1/audio/speech/batch", "/v1/audio/speech/stream",
                  "/v1/realtime", "/v1/audio/voices", "/v1/models", "/health", "/metrics"):
        assert route in help_text


def test_the_command_line_prints_no_transformers_progress_bar():
    # loading the shipped demo LM through transformers would draw its "Loading weights" tqdm bar
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_DISABLE_PROGRESS_BARS"}
    code = "import sys; from omnimtp.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["spec", "--prompt", "import os", "-k", "1", "--max-new-tokens", "2"]
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert "tau" in out.stdout and "Loading weights" not in out.stderr, out.stderr
    shown = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**env, "HF_HUB_DISABLE_PROGRESS_BARS": "0"})
    assert "Loading weights" in shown.stderr  # the test can fail: the bar is there when asked for

"""The README and every page of docs/ run as written, on the tiny models that ship with the package.

Every command of their ```bash blocks is either run (the `omnimtp` CLI's own `main`, in this process, with
small --max-new-tokens / --max-frames added where it has none) or listed in NOT_RUN with the reason; every
```python block is executed (its pipelines capped to a few tokens and frames; the OpenAI client's snippets
against the app `omnimtp serve --eager` builds). A documented command that is neither, or a NOT_RUN entry
that matches no command, fails the test, so the list follows the documentation.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image
from server_harness import running_server

from omnimtp.cli import build_parser, main
from omnimtp.pipeline import OmniPipeline

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# command prefix (as shlex.join writes it) → why the test does not run it
NOT_RUN = {
    "python3 -m venv": "installation: the test runs in the installed tree",
    ". .venv/bin/activate": "installation",
    "pip install": "installation",
    "python -m pytest": "the test suite itself",
    "ruff check": "the lint gate (.ci/run runs it before the tests)",
    "python scripts/mutation_check.py --check-snippets": "the lint gate (.ci/run runs it before the tests)",
    "omnimtp serve --model Qwen3-TTS-12Hz-0.6B-CustomVoice --quantize w4a8 --port 8000": (
        "a server that runs until stopped: test_the_real_speech_server_builds builds its app on the stand-in"),
    "omnimtp serve --model Qwen3-TTS": "a released checkpoint (tests/test_server_tts.py serves the tiny one)",
    "hf download": "downloads a released checkpoint",
    "omnimtp speak 'Tell me a joke' -o joke.wav --model": "a released checkpoint",
    "omnimtp speak 'Tell me a joke' -o joke.flac --model": "a released checkpoint",
    "omnimtp chat": "interactive (tests/test_speak_cli.py answers two turns)",
    "omnimtp serve --port 8000": "a server that runs until stopped: the OpenAI snippet runs against its app",
    "omnimtp serve '[--model'": "a synopsis of serve's flags",
    "omnimtp serve --model OMNI_DIR": "placeholder directories (your checkpoint and its trained head)",
    "omnimtp speak 'def f(x):' -o out.wav --model OMNI_DIR": "placeholder directories",
    "omnimtp train-mtp": "placeholder directories and a long training run (tests/test_train_mtp.py)",
    "omnimtp gen-distill-data": "placeholder directories (tests/test_self_distill.py)",
    "omnimtp serve --replicas": "Ray Serve replicas (tests/test_ray.py)",
    "omnimtp serve --min-replicas": "Ray Serve autoscaling (tests/test_ray.py)",
    "omnimtp batch": "a Ray Data job over your prompts.jsonl (tests/test_ray.py)",
    "omnimtp voice create --model Qwen3-TTS": (
        "a released checkpoint (tests/test_voice_cli.py clones with the tiny one)"
    ),
    "omnimtp speak --model Qwen3-TTS-12Hz-0.6B-Base": "a released checkpoint (tests/test_voice_cli.py)",
    "omnimtp quantize Qwen3-Omni-30B-A3B-Instruct": (
        "a released checkpoint (tests/test_quantized_checkpoint.py converts the tiny ones)"
    ),
    "omnimtp speak Hello --model qwen3-omni-w4a8": "the quantized copy of a released checkpoint",
    "omnimtp serve --model tiny-asr --aligner-model tiny-aligner": (
        "a server that runs until stopped (tests/test_server_asr.py serves both through the openai client)"),
    "omnimtp serve --model Qwen3-ASR-0.6B": "released checkpoints (tests/test_server_asr.py serves the tiny ones)",
    "python -m venv qwentts-venv": "the CPU peer's own environment (benchmark setup; the peer is not installed here)",
    "qwentts-venv/bin/pip install": "installation of the CPU peer",
    "python benchmarks/tts_realtime.py --model DIR": (
        "a benchmark on a released-width checkpoint (minutes; tests/test_realtime_benchmarks.py runs its quick mode)"),
    "omnimtp serve --asr-model tiny-asr": (
        "a server that runs until stopped (tests/test_server_asr.py builds its app and serves the pair)"),
}
# A released checkpoint's directory, as `hf download --local-dir` leaves it, stood in for by the tiny model of its
# kind saved in the released layout: the documented commands on it run as written.
STAND_INS = {"Qwen3-TTS-12Hz-0.6B-CustomVoice": "tiny-tts"}
# caps added to a command that sets none, so a run takes seconds
CAPS = {"speak": {"--max-new-tokens": "4", "--max-frames": "6"}, "spec": {"--max-new-tokens": "16"}}
SNIPPET_CAPS = dict(max_new_tokens=6, max_frames=8)

_FENCE = re.compile(r"^(?P<indent> *)```(?P<language>\w*)\s*$")


def doc_blocks(language: str) -> list[tuple[str, str]]:
    """(file name, block) of every fenced block in `language` of the README and docs/, in order, each dedented
    to its fence."""
    return [(doc.name, block) for doc in DOCS for block in file_blocks(doc.read_text(), language)]


def file_blocks(text: str, language: str) -> list[str]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        i += 1
        if fence is None or not fence["language"]:
            continue
        indent, body = len(fence["indent"]), []
        while not re.fullmatch(r" *```\s*", lines[i]):
            body.append(lines[i][indent:])
            i += 1
        i += 1
        if fence["language"] == language:
            blocks.append("\n".join(body) + "\n")
    return blocks


def readme_commands() -> list[list[str]]:
    """Every command of the ```bash blocks as argv: continuations joined, comments cut, `&&` chains split."""
    commands = []
    for _, block in doc_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens:
                cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                commands.append(tokens[:cut])
                tokens = tokens[cut + 1:]
    return commands


def why_not_run(command: list[str]) -> str | None:
    line = shlex.join(command)
    return next((reason for prefix, reason in NOT_RUN.items() if line.startswith(prefix)), None)


def with_caps(argv: list[str]) -> list[str]:
    caps = CAPS.get(argv[0], {})
    return argv + [item for flag, value in caps.items() if flag not in argv for item in (flag, value)]


@pytest.fixture
def readme_dir(tmp_path, monkeypatch):
    """A working directory holding the README's sample inputs, as the repository root does, and the stand-ins
    of the checkpoints it downloads."""
    shutil.copytree(REPO_ROOT / "examples", tmp_path / "examples")
    for directory, tiny in STAND_INS.items():
        OmniPipeline.from_pretrained(tiny).save_pretrained(tmp_path / directory)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def capped_pipelines(monkeypatch):
    """Every OmniPipeline the snippets make stops after a few tokens and frames."""
    init = OmniPipeline.__init__

    def capped(self, *args, **kwargs):
        init(self, *args, **{**kwargs, **SNIPPET_CAPS})

    monkeypatch.setattr(OmniPipeline, "__init__", capped)


def test_every_command_is_run_or_listed_with_a_reason():
    commands = readme_commands()
    assert len(commands) >= 20
    unlisted = [shlex.join(c) for c in commands if c[0] != "omnimtp" and why_not_run(c) is None]
    assert not unlisted, f"documented commands neither run here nor in NOT_RUN: {unlisted}"
    lines = [shlex.join(c) for c in commands]
    stale = [prefix for prefix in NOT_RUN if not any(line.startswith(prefix) for line in lines)]
    assert not stale, f"NOT_RUN entries that match no documented command: {stale}"


def test_the_cli_commands_run(readme_dir, capsys):
    run = []
    for command in readme_commands():
        if why_not_run(command) is not None or command in run:
            continue
        assert command[0] == "omnimtp", command
        argv = with_caps(command[1:])
        assert main(argv) == 0, f"{shlex.join(command)}: {capsys.readouterr().err[-2000:]}"
        if "-o" in argv:
            audio, rate = soundfile.read(argv[argv.index("-o") + 1])
            assert rate == 24_000 and len(audio) > 0 and np.abs(audio).max() > 0, shlex.join(command)
        run.append(command)
    assert {"speak", "spec"} <= {c[1] for c in run} and len(run) >= 4
    assert_ignored_by_git(readme_dir)


def test_the_real_speech_server_builds(readme_dir):
    """The documented `serve` of a downloaded checkpoint: its flags parse and its app builds (quantized as it
    says) on the stand-in checkpoint."""
    from omnimtp.server.build import build_app

    served = [c for c in readme_commands() if c[:2] == ["omnimtp", "serve"] and "--model" in c
              and c[c.index("--model") + 1] in STAND_INS]
    assert any("--quantize" in c for c in served), "the README serves no downloaded checkpoint"
    for command in served:
        engine, _ = build_app(build_parser().parse_args(command[1:]))
        quantize = command[command.index("--quantize") + 1] if "--quantize" in command else None
        assert engine.model_id in STAND_INS and engine.family.quantize == quantize, shlex.join(command)


def test_ci_runs_the_readmes_install_line_and_test_commands():
    """`.ci/run` runs, as written, the README's install line (with its first result) and its test commands; every
    line of those blocks but the virtualenv's, which CI makes in its own folder."""
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    blocks = file_blocks((REPO_ROOT / "README.md").read_text(), "bash")
    install, tests = blocks[0].splitlines(), next(b for b in blocks if "python -m pytest" in b).splitlines()
    assert install[0].startswith("python3 -m venv") and "omnimtp speak" in install[1]
    for line in install[1:] + tests:
        assert line in ci, f".ci/run does not run the README's {line!r}"


def test_the_python_snippets_run(readme_dir, capped_pipelines, capfd):
    blocks = doc_blocks("python")
    assert len(blocks) >= 12 and {name for name, _ in blocks} >= {"README.md", "speech.md", "tts.md"}
    served = [(name, block) for name, block in blocks if "from openai import OpenAI" in block]
    assert len(served) >= 4
    for name, block in blocks:
        if (name, block) not in served:
            exec(compile(block, name, "exec"), {"__name__": "readme"})
    # the OpenAI client against what `omnimtp serve --eager` serves (on a free port instead of 8000)
    from omnimtp.server.build import build_app

    args = build_parser().parse_args(["serve", "--eager", "--max-frames", "8", "--max-tokens-limit", "8"])
    _, app = build_app(args)
    with running_server(app) as url:
        for name, snippet in served:
            block = snippet.replace("127.0.0.1:8000", url.removeprefix("http://"))
            assert block != snippet, name
            namespace = {"__name__": "readme"}
            exec(compile(block, name, "exec"), namespace)
            # what each snippet fetched is there: its audio files, streamed PCM, a realtime reply
            for file in ("reply.wav", "hello.wav"):
                if f'"{file}"' in block:
                    assert Path(file).stat().st_size > 44, (name, file)
                    Path(file).unlink()
            if "pcm" in namespace:
                assert namespace["pcm"], name
            if "spoken" in namespace:
                assert namespace["spoken"] and namespace["event"].response.status in ("completed", "incomplete"), name
    assert_ignored_by_git(readme_dir)
    assert "Loading weights" not in capfd.readouterr().err  # the shipped demos load without a progress bar


def assert_ignored_by_git(directory: Path) -> None:
    """The files the documentation's commands wrote (here, in `directory`) are ones .gitignore ignores: run from
    a clone's root, they leave `git status` clean."""
    written = sorted(str(path.relative_to(directory)) for path in directory.rglob("*")
                     if path.is_file() and path.relative_to(directory).parts[0] != "examples")
    assert written, "the commands wrote nothing"
    checked = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], input="\n".join(written),
                             cwd=REPO_ROOT, capture_output=True, text=True)
    shown = sorted(set(written) - set(checked.stdout.split()))
    assert not shown, f"the documentation's commands leave files git status shows: {shown}"


def test_the_shipped_samples_are_what_make_samples_writes(tmp_path):
    import runpy

    script = runpy.run_path(str(REPO_ROOT / "scripts" / "make_samples.py"))
    audio_path, image_path = script["write_samples"](tmp_path)
    written, rate = soundfile.read(audio_path, dtype="int16")
    shipped, shipped_rate = soundfile.read(REPO_ROOT / "examples" / "question.wav", dtype="int16")
    assert rate == shipped_rate == 16_000 and np.array_equal(written, shipped) and np.abs(shipped).max() > 1000
    assert np.array_equal(np.asarray(Image.open(image_path)),
                          np.asarray(Image.open(REPO_ROOT / "examples" / "photo.png")))


def test_the_fast_subset_names_existing_files():
    """`-m "not slow"` (the README's fast subset) runs exactly the files conftest lists."""
    from conftest import FAST_FILES

    missing = sorted(name for name in FAST_FILES if not (REPO_ROOT / "tests" / name).is_file())
    assert not missing, f"FAST_FILES names files that do not exist: {missing}"
    assert "test_readme.py" in FAST_FILES

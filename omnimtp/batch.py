"""`omnimtp batch`: speech for a file of prompts with Ray Data, one audio file and one JSON line each.

    omnimtp batch --input prompts.jsonl --output out/ [--replicas 2] [--model DIR]

Each input line is a JSON object: `id` (letters, digits, `.`, `_`, `-`; unique), and `prompt` (a string)
or `messages` (chat turns with text content); optionally `voice` (default --voice) and `seed` (sample
with Qwen3-Omni's defaults, as `omnimtp speak --seed`; without it the request is greedy). On a Qwen3-TTS
model `prompt` is the text to speak (no chat), optionally with `language` and `instructions`, and `seed`
samples with `QWEN3_TTS_SAMPLING`; on a Qwen3-TTS Base model `voice` is a voice file (`omnimtp voice create`),
at its path on every node.

Ray Data reads the pending prompts and `map_batches` runs them through `OmniPipeline.generate` on
--replicas actors (each loads the model once and generates --batch-size prompts at a time). The driver
writes each result as it arrives: `DIR/<id>.wav` first, then its line in `DIR/results.jsonl`
(`{"id", "audio", "text", "finish_reason", "num_frames", "audio_seconds"}`), flushed. A line exists only
for a finished prompt, so a run that was interrupted is resumed by running the same command again: ids
already in results.jsonl are skipped (a torn last line is dropped), and no id is written twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings

from omnimtp.argtypes import (
    add_quantize_argument,
    add_reply_caps,
    add_verbose_argument,
    non_negative_float,
    positive_int,
)

RESULTS_FILE = "results.jsonl"
AUDIO_FORMATS = ("wav", "flac")
_ID = re.compile(r"[A-Za-z0-9._-]{1,200}")
TTS_FIELDS = ("language", "instructions")  # the row fields only a Qwen3-TTS model takes


class BatchInputError(ValueError):
    """A prompt file that cannot be run; the message names the line."""


def add_parser(subparsers) -> None:
    from omnimtp.server.ray_serve import INSTALL_HINT

    parser = subparsers.add_parser(
        "batch", help="speech for a JSONL file of prompts with Ray Data (resumable)",
        description=__doc__.split("\n\n")[2].strip() + f" Needs Ray: {INSTALL_HINT}.",
    )
    parser.add_argument("--input", required=True, metavar="FILE", help="JSONL prompts: {\"id\", \"prompt\" | "
                        "\"messages\", \"voice\"?, \"seed\"?} per line; on a Qwen3-TTS model {\"id\", \"prompt\" "
                        "(the text to speak), \"voice\"?, \"language\"?, \"instructions\"?, \"seed\"?}")
    parser.add_argument("--output", required=True, metavar="DIR", help="audio files and results.jsonl go here")
    parser.add_argument("--model", metavar="DIR", help="a Qwen3-Omni, Qwen2.5-Omni or Qwen3-TTS checkpoint directory "
                        "(default: embedded tiny); on a cluster, at this path on every node")
    parser.add_argument("--voice", default=None, help="the voice of prompts without one (default: the model's; "
                        "a Qwen3-TTS Base model: a voice file from `omnimtp voice create`)")
    parser.add_argument("--format", choices=AUDIO_FORMATS, default="wav", help="audio file format")
    add_reply_caps(parser)
    parser.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                        help="pipeline actors generating at once (default %(default)d)")
    add_quantize_argument(parser)
    parser.add_argument("--batch-size", type=positive_int, default=4, metavar="B",
                        help="prompts one actor generates together (default %(default)d)")
    parser.add_argument("--num-cpus-per-replica", type=non_negative_float, default=1.0, metavar="C",
                        help="CPUs Ray reserves for each actor (default %(default)g; fractions allowed)")
    parser.add_argument("--num-gpus-per-replica", type=non_negative_float, default=0.0, metavar="G",
                        help="GPUs Ray reserves for each actor (default %(default)g)")
    parser.add_argument("--ray-address", metavar="ADDR", help="the Ray cluster to run on (default: a local instance)")
    add_verbose_argument(parser)
    parser.set_defaults(handler=run)


# -- input and output files ---------------------------------------------------------------------------


def read_prompts(path: str) -> list[dict]:
    """The prompt file's rows, checked: {"id", "prompt" | "messages", "voice"?, "seed"?}. Raises
    BatchInputError naming the line."""
    rows, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BatchInputError(f"{where}: not valid JSON ({exc})") from None
            rows.append(_check_row(row, where))
            if row["id"] in seen:
                raise BatchInputError(f"{where}: id {row['id']!r} is also on line {seen[row['id']]}")
            seen[row["id"]] = number
    return rows


def _check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise BatchInputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    unknown = sorted(set(row) - {"id", "prompt", "messages", "voice", "seed", *TTS_FIELDS})
    if unknown:
        raise BatchInputError(f"{where}: unknown field {unknown[0]!r} (fields: id, prompt | messages, voice, seed; "
                              "Qwen3-TTS: language, instructions)")
    for name in TTS_FIELDS:
        if name in row and not isinstance(row[name], str):
            raise BatchInputError(f"{where}: {name} must be a string")
    if not isinstance(row.get("id"), str) or not _ID.fullmatch(row["id"]):
        raise BatchInputError(f"{where}: id must be 1-200 letters, digits, '.', '_' or '-' (it names the audio "
                              f"file), got {row.get('id')!r}")
    if ("prompt" in row) == ("messages" in row):
        raise BatchInputError(f"{where}: give exactly one of prompt and messages")
    if "prompt" in row and (not isinstance(row["prompt"], str) or not row["prompt"].strip()):
        raise BatchInputError(f"{where}: prompt must be a non-empty string")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str)
                and isinstance(m["content"], str) for m in messages):
            raise BatchInputError(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} "
                                  "objects with string content")
    if "voice" in row and not isinstance(row["voice"], str):
        raise BatchInputError(f"{where}: voice must be a string")
    seed = row.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63):
        raise BatchInputError(f"{where}: seed must be an integer within int64, got {seed!r}")
    return row


def finished_ids(output_dir: str) -> set[str]:
    """The ids results.jsonl already holds. A last line without its newline (the run was killed while
    writing it) is cut off, so that the next line starts clean."""
    path = os.path.join(output_dir, RESULTS_FILE)
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return {json.loads(line)["id"] for line in complete.splitlines() if line.strip()}


def write_result(output_dir: str, result: dict, audio: bytes, fmt: str, results) -> None:
    """The audio file (written aside, then renamed), then the result's line, flushed to disk."""
    name = f"{result['id']}.{fmt}"
    path = os.path.join(output_dir, name)
    with open(path + ".part", "wb") as f:
        f.write(audio)
    os.replace(path + ".part", path)
    results.write(json.dumps({"id": result["id"], "audio": name, **{k: v for k, v in result.items() if k != "id"}})
                  + "\n")
    results.flush()
    os.fsync(results.fileno())


# -- the pipeline actors ------------------------------------------------------------------------------


class PipelineSpeaker:
    """A Ray Data actor: the pipeline, loaded once; each call generates one batch of rows
    ({"id", "request": JSON of the row}) → {"id", "text", "finish_reason", "num_frames", "audio_seconds",
    "audio": encoded bytes}."""

    def __init__(self, model: str | None, voice: str | None, fmt: str, max_new_tokens: int | None,
                 max_frames: int | None, batch_size: int, quantize: str | None = None,
                 codec_dtype: str | None = None):
        import torch

        from omnimtp.console import quiet_expected_warnings
        from omnimtp.pipeline import OmniPipeline

        quiet_expected_warnings()
        if model is None:
            torch.set_num_threads(1)  # the tiny model's ops are too small to split; threads only contend
            self.pipe = OmniPipeline.tiny(quantize=quantize, codec_dtype=codec_dtype)
        else:
            self.pipe = OmniPipeline.from_pretrained(model, max_batch_size=batch_size, quantize=quantize,
                                                     codec_dtype=codec_dtype)
        self.voice = self.pipe.family.default_speaker if voice is None else voice
        self.voice_files: dict[str, object] = {}  # a Base model's voices, each file read once
        self.fmt = fmt
        self.limits = dict(max_new_tokens=max_new_tokens, max_frames=max_frames)

    def __call__(self, batch: dict) -> dict:
        from omnimtp.sampling import QWEN3_OMNI_THINKER_SAMPLING as thinker_sampling
        from omnimtp.server.audio import encode_audio

        rows = [json.loads(request) for request in batch["request"]]
        if not self.pipe.family.has_chat:
            return self._speak_texts(rows)
        groups: dict[tuple, list[int]] = {}  # one generate call per voice, sampled or greedy
        for index, row in enumerate(rows):
            voice = self.pipe.family.match_speaker(row.get("voice", self.voice))
            groups.setdefault((voice, row.get("seed") is None), []).append(index)
        columns = {name: [None] * len(rows) for name in ("id", "text", "finish_reason", "num_frames",
                                                          "audio_seconds", "audio")}
        for (voice, is_greedy), indices in groups.items():
            prompts = [rows[i].get("prompt", rows[i].get("messages")) for i in indices]
            sampling = {} if is_greedy else {
                "thinker_sampling": thinker_sampling, "seed": [rows[i]["seed"] for i in indices],
                "talker_sampling": self.pipe.family.sampled_talker(thinker_sampling)}
            outputs = self.pipe.generate(prompts, speaker=voice, **sampling, **self.limits)
            for i, output in zip(indices, outputs, strict=True):
                columns["id"][i] = rows[i]["id"]
                columns["text"][i] = output.text
                columns["finish_reason"][i] = output.finish_reason
                columns["num_frames"][i] = int(output.codes.shape[-1])
                columns["audio_seconds"][i] = len(output.audio) / output.sample_rate
                columns["audio"][i] = encode_audio(output.audio, output.sample_rate, self.fmt)
        return columns

    def _speak_texts(self, rows: list[dict]) -> dict:
        """A Qwen3-TTS model's batch: each row's prompt spoken in its voice, language and instructions (one
        `speech` call for the greedy rows and one for the sampled)."""
        from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING
        from omnimtp.server.audio import encode_audio

        columns = {name: [None] * len(rows) for name in ("id", "text", "finish_reason", "num_frames",
                                                          "audio_seconds", "audio")}
        for is_greedy in (True, False):
            indices = [i for i, row in enumerate(rows) if (row.get("seed") is None) == is_greedy]
            if not indices:
                continue
            chosen = [rows[i] for i in indices]
            outputs = self.pipe.speech(
                [row.get("prompt") for row in chosen],
                voice=[self._voice(row.get("voice", self.voice)) for row in chosen],
                language=[row.get("language") for row in chosen],
                instructions=[row.get("instructions") for row in chosen],
                sampling=None if is_greedy else QWEN3_TTS_SAMPLING,
                seed=None if is_greedy else [row["seed"] for row in chosen], max_frames=self.limits["max_frames"],
            )
            for i, output in zip(indices, outputs, strict=True):
                columns["id"][i] = rows[i]["id"]
                columns["text"][i] = rows[i].get("prompt")
                columns["finish_reason"][i] = output.finish_reason
                columns["num_frames"][i] = int(output.codes.shape[-1])
                columns["audio_seconds"][i] = len(output.audio) / output.sample_rate
                columns["audio"][i] = encode_audio(output.audio, output.sample_rate, self.fmt)
        return columns


    def _voice(self, voice: str | None):
        """A row's voice as `speech` takes it: a Base model's voice file read as a `Voice`, else the name."""
        if voice is None or getattr(self.pipe.family, "tts_model_type", None) != "base":
            return voice
        if voice not in self.voice_files:
            from omnimtp.voice import Voice

            self.voice_files[voice] = Voice.load(voice)
        return self.voice_files[voice]


# -- the job ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        rows = read_prompts(args.input)
    except (OSError, BatchInputError) as exc:
        return _refuse(str(exc))
    if args.num_cpus_per_replica < 0 or args.num_gpus_per_replica < 0:
        return _refuse("--num-cpus-per-replica and --num-gpus-per-replica must be >= 0")
    if args.model is None and args.batch_size > 8:
        return _refuse("--batch-size: the embedded tiny pipeline generates at most 8 prompts together")
    voices = {row.get("voice", args.voice) for row in rows} - {None}
    try:
        check_voices(args.model, voices)
        check_model_fields(args.model, rows)
    except ValueError as exc:
        return _refuse(str(exc))
    try:
        import ray
        import ray.data
    except ImportError as exc:
        from omnimtp.server.ray_serve import INSTALL_HINT

        return _refuse(f"omnimtp batch runs on Ray Data, which is not installed ({exc}); install it with: "
                       f"{INSTALL_HINT}")
    from tqdm import tqdm

    os.makedirs(args.output, exist_ok=True)
    done = finished_ids(args.output)
    pending = [row for row in rows if row["id"] not in done]
    print(f"omnimtp batch: {len(rows)} prompts, {len(rows) - len(pending)} already in "
          f"{os.path.join(args.output, RESULTS_FILE)}, {len(pending)} to go", flush=True)
    if not pending:
        return 0
    from omnimtp.console import interrupt_on_signals, signals_ignored, stopped_by
    from omnimtp.server.ray_serve import init_ray

    num_done = len(rows) - len(pending)
    try:
        init_ray(args.ray_address, verbose=args.verbose)
        interrupt_on_signals()  # Ray's handlers replaced: Ctrl-C and SIGTERM stop the job
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the job's own bar counts prompts
        dataset = ray.data.from_items([{"id": row["id"], "request": json.dumps(row)} for row in pending])
        with warnings.catch_warnings():  # (Ray 2.60 names no other way to pass max_restarts; the pin is < 2.61)
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            results = dataset.map_batches(
                PipelineSpeaker, batch_size=args.batch_size, batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=args.replicas),
                fn_constructor_args=(args.model, args.voice, args.format, args.max_new_tokens, args.max_frames,
                                     args.batch_size, args.quantize, args.codec_dtype),
                num_cpus=args.num_cpus_per_replica, num_gpus=args.num_gpus_per_replica,
                # a replica that dies ends the job (rerunning resumes it) rather than restarting: Ray logs an
                # error-level line for every restartable actor whose constructor arguments sit in the object store,
                # as Ray Data's always do, and a replica killed for its memory would only die again
                max_restarts=0,
            )
        with open(os.path.join(args.output, RESULTS_FILE), "a", encoding="utf-8") as out, \
                tqdm(total=len(rows), initial=len(rows) - len(pending), unit="prompt") as progress:
            for row in results.iter_rows():
                result = {name: _plain(row[name]) for name in ("id", "text", "finish_reason", "num_frames",
                                                               "audio_seconds")}
                write_result(args.output, result, bytes(row["audio"]), args.format, out)
                num_done += 1
                progress.update(1)
    except KeyboardInterrupt as exc:
        signum = stopped_by(exc)
        # what the file holds: the signal may land between a result's write and the count
        num_done = len({row["id"] for row in rows} & finished_ids(args.output))
        print(f"omnimtp batch: stopped ({signum.name}) with {num_done} of {len(rows)} prompts done; run the same "
              "command again to finish the rest", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        with signals_ignored():
            ray.shutdown()
    return 0


def check_model_fields(model: str | None, rows: list[dict]) -> None:
    """ValueError naming the row's id unless every row is something the model does (read from the checkpoint's
    config, before Ray starts): a Qwen3-TTS model speaks `prompt` texts (no `messages`); only it takes
    `language` and `instructions`."""
    model_type = None
    if model is not None:
        with open(os.path.join(model, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    is_tts = model_type == "qwen3_tts"
    for row in rows:
        if is_tts and "messages" in row:
            raise ValueError(f"id {row['id']!r}: a Qwen3-TTS model has no chat; give the text to speak as prompt")
        given = [name for name in TTS_FIELDS if name in row]
        if given and not is_tts:
            raise ValueError(f"id {row['id']!r}: {given[0]} is taken only by a Qwen3-TTS model")


def check_voices(model: str | None, voices: set[str]) -> None:
    """ValueError unless the model has every voice (read from the checkpoint's config, before Ray starts)."""
    if not voices:
        return
    if model is None:
        from omnimtp.models.tiny import TINY_SPEAKERS

        speakers = set(TINY_SPEAKERS)
    else:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        if config.get("tts_model_type") == "base":  # voices are voice files
            missing = sorted(voice for voice in voices if not os.path.isfile(voice))
            if missing:
                raise ValueError(f"voice: no voice file {missing[0]!r} (a Base model speaks voice files from "
                                 "`omnimtp voice create`)")
            return
        talker_config = config["talker_config"]
        speakers = set(talker_config.get("speaker_id") or talker_config.get("spk_id") or {})  # Qwen3-TTS: spk_id
    lowered = {speaker.lower() for speaker in speakers}
    unknown = sorted(voice for voice in voices if voice.lower() not in lowered)
    if unknown:
        raise ValueError(f"unknown voice {unknown[0]!r}; this model has: {', '.join(sorted(speakers))}")


def _plain(value):
    """A numpy scalar of a Ray Data row as its Python value (for JSON)."""
    return value.item() if hasattr(value, "item") else value


def _refuse(message: str) -> int:
    print(f"omnimtp batch: error: {message}", file=sys.stderr)
    return 2

"""The server's saved voices: one embedded SQLite database, `voices.sqlite3` under `--voices-dir`.

A row is one voice: its name, the `omnimtp.voice.Voice` as the bytes of `Voice.to_bytes()` (speaker
embedding, and for an in-context voice the reference codes and transcript ids), and what a user asks about
it later: when it was made, its mode ("x_vector" or "icl"), the reference's length in seconds, the
transcript, the consent record (the statement or consent id the client sent, the `user` it named, the
client address, the time) and the model it was made for. The reference recording itself is kept only when
the store is opened with `keep_audio=True` (`--keep-voice-audio`).

Every write is one transaction: a voice is inserted whole (metadata and blob in one row) or not at all, so a
process killed in the middle of a POST leaves the voice complete or absent, and the store opens as before.
The write takes SQLite's write lock first (`BEGIN IMMEDIATE`), so the voice limit is counted and the name
checked under the same lock the insert holds: concurrent writers, in one process or several, never exceed
`max_voices` or create one name twice.

Several processes (Ray Serve replicas, several `omnimtp serve`) may open the same directory: the database is
in WAL mode (readers never block the writer, nor it them) and a writer waits up to `BUSY_TIMEOUT_S` for
another's transaction instead of failing. That needs the directory on one host's filesystem, or a shared
POSIX volume whose byte-range locks work across hosts (and, for WAL's shared-memory index, every process on
the same host as the file's lock manager sees it: in practice one node, or a cluster filesystem with
coherent mmap). Not supported: NFS or SMB without working locks (`nolock`, some object-store mounts), where
two writers can corrupt the file, and WAL across hosts on plain NFS. A cluster of several nodes keeps the
replicas that share a directory on one node, or sends each request its voice (`ref_audio`, `speaker_embedding`)
instead of saving it; a store opened on a network filesystem logs a warning. No process keeps a copy of a
voice: each request reads its row, so a voice saved or deleted by one process is seen by every other at its
next request.

The store never touches the event loop: its methods block (each opens its own connection) and the routes
run them in a worker thread.

    store = VoiceStore("/var/lib/omnimtp/voices", max_voices=100)
    store.add(NewVoice(name="alice", voice=voice.to_bytes(), mode="icl", seconds=4.2, consent="...", model="base"))
    store.voice_bytes("alice")   # → bytes for Voice.from_bytes
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("omnimtp.server")

DB_NAME = "voices.sqlite3"
DEFAULT_MAX_VOICES = 1000
BUSY_TIMEOUT_S = 30.0
MAX_NAME_LENGTH = 64
# A letter or digit, then letters, digits, '_' or '-': a name is never a path, a dot-file or a URL escape.
NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_NAME_LENGTH - 1}}}")
MAX_CONSENT_LENGTH = 4096
_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    name TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    mode TEXT NOT NULL,
    seconds REAL NOT NULL,
    ref_text TEXT,
    consent TEXT NOT NULL,
    consent_user TEXT,
    consent_client TEXT,
    consent_at REAL NOT NULL,
    model TEXT NOT NULL,
    voice BLOB NOT NULL,
    audio BLOB,
    audio_format TEXT
)
"""
# Filesystem types (Linux mountinfo) whose files other hosts can open: SQLite's WAL index is shared memory,
# which does not reach across hosts, and their locks are not all real.
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs",
                                 "lustre", "gpfs", "fuse.sshfs", "fuse.glusterfs", "fuse.s3fs", "fuse.gcsfuse"})
MOUNTINFO = "/proc/self/mountinfo"
_SUMMARY_COLUMNS = ("name, created_at, mode, seconds, ref_text, consent, consent_user, consent_client, consent_at, "
                    "model, audio IS NOT NULL")


class VoiceStoreError(ValueError):
    """A request the store refuses: `status` (the HTTP status it maps to), `param` (the field), `code`."""

    status = 400
    code = "invalid_value"

    def __init__(self, message: str, param: str | None = "name"):
        super().__init__(message)
        self.param = param


class UnknownVoiceError(VoiceStoreError):
    status = 404
    code = "voice_not_found"


class DuplicateVoiceError(VoiceStoreError):
    status = 409
    code = "voice_exists"


class TooManyVoicesError(VoiceStoreError):
    status = 400
    code = "too_many_voices"


def check_name(name) -> str:
    """`name` when it is a valid voice name (`NAME`: 1..64 of A-Z a-z 0-9 _ -, starting with a letter or digit);
    VoiceStoreError naming `name` otherwise."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name) if isinstance(name, str) and len(name) <= 2 * MAX_NAME_LENGTH else "the name"
        raise VoiceStoreError(f"name: {shown} is not a voice name: 1 to {MAX_NAME_LENGTH} letters, digits, '_' or "
                              "'-', starting with a letter or digit")
    return name


@dataclass(frozen=True)
class NewVoice:
    """What a POST saves. voice: `Voice.to_bytes()`; consent: the client's statement or consent id (required,
    non-empty); consent_user / consent_client: who gave it (the request's `user`, the client address);
    audio / audio_format: the reference recording as uploaded, kept only by a `keep_audio` store."""

    name: str
    voice: bytes
    mode: str
    seconds: float
    consent: str
    model: str
    ref_text: str | None = None
    consent_user: str | None = None
    consent_client: str | None = None
    audio: bytes | None = None
    audio_format: str | None = None


@dataclass(frozen=True)
class SavedVoice:
    """A saved voice's metadata (what GET returns), without its blob."""

    name: str
    created_at: float
    mode: str
    seconds: float
    ref_text: str | None
    consent: str
    consent_user: str | None
    consent_client: str | None
    consent_at: float
    model: str
    has_audio: bool

    def summary(self) -> dict:
        """The list entry: name, created_at (Unix seconds), mode, seconds, model."""
        return {"name": self.name, "created_at": int(self.created_at), "mode": self.mode,
                "seconds": round(self.seconds, 3), "model": self.model}

    def details(self) -> dict:
        """One voice: the summary, its transcript, whether the recording is kept, and the consent record."""
        consent = {"statement": self.consent, "user": self.consent_user, "client": self.consent_client,
                   "recorded_at": int(self.consent_at)}
        return {**self.summary(), "ref_text": self.ref_text, "has_audio": self.has_audio, "consent": consent}


class VoiceStore:
    """Saved voices in `directory`/voices.sqlite3 (created with the directory when missing).

    max_voices: the most voices the store holds (over all processes that share it). keep_audio: keep each
    reference recording as uploaded. in_transaction: called inside each add's transaction after its
    insert, before the commit (a fault test's window; None in service). ValueError naming the argument for
    a directory that cannot hold the database or a filesystem without WAL."""

    def __init__(self, directory, *, max_voices: int = DEFAULT_MAX_VOICES, keep_audio: bool = False,
                 in_transaction: Callable[[], None] | None = None):
        if isinstance(max_voices, bool) or not isinstance(max_voices, int) or max_voices < 1:
            raise ValueError(f"max_voices must be an integer >= 1, got {max_voices!r}")
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, DB_NAME)
        self.max_voices = max_voices
        self.keep_audio = bool(keep_audio)
        self._in_transaction = in_transaction
        try:
            os.makedirs(self.directory, exist_ok=True)
            with self._connection() as conn:
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise ValueError(f"voices_dir: {self.directory!r} is on a filesystem without SQLite's WAL mode "
                                     f"(journal mode {mode!r}); use a local disk or a POSIX volume with working locks")
                kind = filesystem_type(self.directory)
                if kind in NETWORK_FILESYSTEMS:
                    logger.warning("voices_dir: %s is on a network filesystem (%s): SQLite's WAL mode needs every "
                                   "process that opens it on one host; two hosts writing can corrupt the voices",
                                   self.directory, kind)
                # A store made before needs no write lock to open (another process may be writing).
                if conn.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA_VERSION:
                    conn.execute("BEGIN IMMEDIATE")
                    version = conn.execute("PRAGMA user_version").fetchone()[0]
                    if version not in (0, _SCHEMA_VERSION):
                        conn.execute("ROLLBACK")
                        raise ValueError(f"voices_dir: {self.path} has voices of schema {version}, this omnimtp "
                                         f"reads {_SCHEMA_VERSION}")
                    conn.execute(_SCHEMA)
                    conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
                    conn.execute("COMMIT")
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"voices_dir: cannot open the voice store at {self.path} ({exc})") from None

    @contextlib.contextmanager
    def _connection(self):
        # One connection per call: a store is used from worker threads, and sqlite3 connections are not shared.
        # isolation_level None: the transactions are the explicit BEGIN IMMEDIATE ... COMMIT below.
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute("PRAGMA synchronous=FULL")  # a committed voice survives a power cut, not only a crash
            yield conn
        finally:
            conn.close()

    def add(self, voice: NewVoice) -> SavedVoice:
        """Save `voice` in one transaction; its SavedVoice. DuplicateVoiceError (409) for a name taken,
        TooManyVoicesError when the store is full, VoiceStoreError for a bad name or consent."""
        check_name(voice.name)
        if not isinstance(voice.consent, str) or not voice.consent.strip():
            raise VoiceStoreError("consent: required: a statement that the speaker agreed to be cloned, or a "
                                  "consent record id", param="consent")
        if len(voice.consent) > MAX_CONSENT_LENGTH:
            raise VoiceStoreError(f"consent: longer than {MAX_CONSENT_LENGTH} characters", param="consent")
        now = time.time()
        audio, audio_format = (voice.audio, voice.audio_format) if self.keep_audio else (None, None)
        row = (voice.name, now, voice.mode, float(voice.seconds), voice.ref_text, voice.consent, voice.consent_user,
               voice.consent_client, now, voice.model, sqlite3.Binary(voice.voice),
               None if audio is None else sqlite3.Binary(audio), audio_format)
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")  # the write lock before the count and the name check
            try:
                if conn.execute("SELECT 1 FROM voices WHERE name = ?", (voice.name,)).fetchone() is not None:
                    raise DuplicateVoiceError(f"name: a voice named {voice.name!r} exists; delete it first or "
                                              "choose another name")
                (count,) = conn.execute("SELECT COUNT(*) FROM voices").fetchone()
                if count >= self.max_voices:
                    raise TooManyVoicesError(f"the voice store is full ({self.max_voices} voices); delete one "
                                             "first", param=None)
                conn.execute("INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
                if self._in_transaction is not None:
                    self._in_transaction()
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return SavedVoice(voice.name, now, voice.mode, float(voice.seconds), voice.ref_text, voice.consent,
                          voice.consent_user, voice.consent_client, now, voice.model, audio is not None)

    def list(self) -> list[SavedVoice]:
        """Every saved voice, by name."""
        with self._connection() as conn:
            rows = conn.execute(f"SELECT {_SUMMARY_COLUMNS} FROM voices ORDER BY name").fetchall()
        return [_saved(row) for row in rows]

    def get(self, name: str) -> SavedVoice:
        """The voice called `name`; UnknownVoiceError (404) when there is none."""
        with self._connection() as conn:
            row = conn.execute(f"SELECT {_SUMMARY_COLUMNS} FROM voices WHERE name = ?", (check_name(name),)).fetchone()
        if row is None:
            raise _unknown(name)
        return _saved(row)

    def voice_bytes(self, name: str) -> bytes | None:
        """The `Voice.to_bytes()` of the voice called `name`, or None when there is none (or `name` is no name)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            return None
        with self._connection() as conn:
            row = conn.execute("SELECT voice FROM voices WHERE name = ?", (name,)).fetchone()
        return None if row is None else bytes(row[0])

    def audio(self, name: str) -> tuple[bytes, str] | None:
        """The kept reference recording of `name` and its format, or None (not kept)."""
        with self._connection() as conn:
            row = conn.execute("SELECT audio, audio_format FROM voices WHERE name = ?", (check_name(name),)).fetchone()
        if row is None:
            raise _unknown(name)
        return None if row[0] is None else (bytes(row[0]), row[1])

    def delete(self, name: str) -> None:
        """Remove the voice called `name`; UnknownVoiceError (404) when there is none."""
        with self._connection() as conn:
            deleted = conn.execute("DELETE FROM voices WHERE name = ?", (check_name(name),)).rowcount
        if deleted == 0:
            raise _unknown(name)


def filesystem_type(path, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem holding `path` ("ext4", "nfs4", ...): that of the deepest mount point above it
    in `mountinfo` (default `MOUNTINFO`, Linux's /proc/self/mountinfo); None where that file cannot be read."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="replace") as file:
            for line in file:
                fields, _, after = line.partition(" - ")
                columns = fields.split()
                if len(columns) < 5 or not after:
                    continue
                mount_point = columns[4].replace("\\040", " ")
                is_above = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if is_above and len(mount_point) >= len(best):
                    best, kind = mount_point, after.split()[0]
    except OSError:
        return None
    return kind


def _saved(row) -> SavedVoice:
    *fields, has_audio = row
    return SavedVoice(*fields, bool(has_audio))


def _unknown(name: str) -> UnknownVoiceError:
    return UnknownVoiceError(f"name: no saved voice named {name!r}")

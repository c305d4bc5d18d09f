"""The saved-voice store (`omnimtp.server.voice_store`): what it keeps, what it refuses, and that it stays whole
when a writer dies or several processes share it. Other processes are plain `python -c` children that import
only the store (no torch), so each costs a fraction of a second."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from omnimtp.server import voice_store
from omnimtp.server.voice_store import (
    DB_NAME,
    DuplicateVoiceError,
    NewVoice,
    TooManyVoicesError,
    UnknownVoiceError,
    VoiceStore,
    VoiceStoreError,
    filesystem_type,
)
from omnimtp.voice import Voice

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _icl_voice() -> Voice:
    generator = torch.Generator().manual_seed(3)
    return Voice(torch.randn(16, generator=generator), torch.randint(0, 64, (16, 5), generator=generator),
                 torch.tensor([5, 6, 7]), ref_text="hello there", seconds=2.5)


def _new(name: str, voice: Voice | None = None, **fields) -> NewVoice:
    voice = voice or Voice(torch.ones(16))
    return NewVoice(**{"name": name, "voice": voice.to_bytes(), "mode": voice.mode, "seconds": voice.seconds,
                       "consent": "recorded with the speaker's written agreement", "model": "tts-base", **fields})


def test_a_voice_round_trips_and_survives_reopening(tmp_path):
    voice = _icl_voice()
    store = VoiceStore(tmp_path / "voices")
    saved = store.add(_new("alice", voice, ref_text="hello there", consent_user="u-1", consent_client="10.0.0.2",
                           audio=b"RIFF....", audio_format="wav"))
    assert saved.summary() == {"name": "alice", "created_at": int(saved.created_at), "mode": "icl",
                               "seconds": 2.5, "model": "tts-base"}
    reopened = VoiceStore(tmp_path / "voices")  # a restart: a new store on the same directory
    assert reopened.get("alice") == saved
    assert saved.details()["consent"] == {"statement": "recorded with the speaker's written agreement",
                                          "user": "u-1", "client": "10.0.0.2", "recorded_at": int(saved.consent_at)}
    back = Voice.from_bytes(reopened.voice_bytes("alice"))
    assert torch.equal(back.speaker_embedding, voice.speaker_embedding)
    assert torch.equal(back.ref_codes, voice.ref_codes) and torch.equal(back.ref_text_ids, voice.ref_text_ids)
    assert back.ref_text == "hello there"
    # the recording is kept only by a keep_audio store
    assert not saved.has_audio and reopened.audio("alice") is None
    keeping = VoiceStore(tmp_path / "voices", keep_audio=True)
    assert keeping.add(_new("bob", audio=b"fLaC...", audio_format="flac")).has_audio
    assert keeping.audio("bob") == (b"fLaC...", "flac")
    assert [v.name for v in reopened.list()] == ["alice", "bob"]
    reopened.delete("alice")
    assert reopened.voice_bytes("alice") is None and [v.name for v in store.list()] == ["bob"]
    with sqlite3.connect(tmp_path / "voices" / DB_NAME) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


BAD_NAMES = ["", "a/b", "../x", "..", ".hidden", "a\\b", "a b", "a:b", "a%2Fb", "é", "-lead", "_lead",
             "x" * 65, "a\x00b", 7, None]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused_naming_the_field(tmp_path, name):
    store = VoiceStore(tmp_path)
    with pytest.raises(VoiceStoreError) as caught:
        store.add(_new(name))
    assert caught.value.status == 400 and caught.value.param == "name"
    assert store.list() == [] and set(os.listdir(tmp_path)) <= {DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"}
    assert store.voice_bytes(name) is None


def test_good_names(tmp_path):
    store = VoiceStore(tmp_path)
    for name in ("a", "A-1_b", "x" * 64, "7"):
        store.add(_new(name))
    assert [v.name for v in store.list()] == sorted(["a", "A-1_b", "x" * 64, "7"])


def test_duplicates_unknowns_consent_and_the_limit(tmp_path):
    store = VoiceStore(tmp_path, max_voices=2)
    store.add(_new("one"))
    with pytest.raises(DuplicateVoiceError) as caught:
        store.add(_new("one"))
    assert caught.value.status == 409
    for consent in ("", "   "):
        with pytest.raises(VoiceStoreError) as caught:
            store.add(_new("two", consent=consent))
        assert caught.value.param == "consent"
    store.add(_new("two"))
    with pytest.raises(TooManyVoicesError):
        store.add(_new("three"))
    for call in (store.get, store.delete, store.audio):
        with pytest.raises(UnknownVoiceError) as caught:
            call("nobody")
        assert caught.value.status == 404
    store.delete("one")
    store.add(_new("three"))  # deleting frees a place
    with pytest.raises(ValueError, match="max_voices"):
        VoiceStore(tmp_path, max_voices=0)


def test_a_directory_that_cannot_hold_the_store_is_a_value_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="voices_dir: cannot open the voice store"):
        VoiceStore(blocker)


def _child(script: str, directory) -> subprocess.Popen:
    """A `python -c` child that opens a store on `directory` (importing only the store) and runs `script`."""
    code = textwrap.dedent("""
        import sys, time
        from omnimtp.server.voice_store import NewVoice, VoiceStore
        directory = sys.argv[1]
        def new(name):
            return NewVoice(name=name, voice=b"blob-" + name.encode(), mode="x_vector", seconds=1.0,
                            consent="yes", model="tts-base")
    """) + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code, str(directory)], cwd=REPO, stdout=subprocess.PIPE, text=True)


def test_a_store_on_a_network_filesystem_is_opened_with_a_warning(tmp_path, monkeypatch, caplog):
    mountinfo = tmp_path / "mountinfo"
    share = tmp_path / "nfs share"
    mountinfo.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                         f"40 22 0:50 / {str(share).replace(' ', chr(92) + '040')} rw - nfs4 host:/export rw\n")
    assert filesystem_type(share / "voices", str(mountinfo)) == "nfs4"
    assert filesystem_type(tmp_path / "nfs", str(mountinfo)) == "ext4"  # a sibling whose name it begins
    assert filesystem_type(tmp_path, str(tmp_path / "missing")) is None
    monkeypatch.setattr(voice_store, "MOUNTINFO", str(mountinfo))
    VoiceStore(tmp_path / "local")
    assert "network filesystem" not in caplog.text
    VoiceStore(share / "voices")  # a test's nfs is a local directory: WAL works, and the warning is logged
    assert "voices_dir:" in caplog.text and "network filesystem (nfs4)" in caplog.text


def test_a_writer_killed_inside_its_transaction_leaves_no_voice(tmp_path):
    """SIGKILL while the insert is made but not committed: the store opens, the voice is absent, the name is free."""
    VoiceStore(tmp_path).add(_new("before"))
    child = _child("""
        def hold():
            print("in transaction", flush=True)
            time.sleep(60)
        VoiceStore(directory, in_transaction=hold).add(new("killed"))
    """, tmp_path)
    assert child.stdout.readline() == "in transaction\n"
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    store = VoiceStore(tmp_path)
    assert [v.name for v in store.list()] == ["before"] and store.voice_bytes("killed") is None
    store.add(_new("killed"))  # the lock died with the writer
    assert Voice.from_bytes(store.voice_bytes("killed")).mode == "x_vector"


def test_processes_sharing_a_directory_wait_for_each_other_and_share_the_limit(tmp_path):
    """One process holds the write lock (inside its transaction) for a second; another process's add waits for
    it instead of failing, then counts the first one's voice against max_voices: the limit holds across
    processes, and both see every voice."""
    VoiceStore(tmp_path)
    child = _child("""
        def hold():
            print("in transaction", flush=True)
            time.sleep(1.0)
        VoiceStore(directory, in_transaction=hold).add(new("first"))
        print("committed", flush=True)
    """, tmp_path)
    assert child.stdout.readline() == "in transaction\n"
    store = VoiceStore(tmp_path, max_voices=2)  # opening takes no lock
    start = time.monotonic()
    store.add(_new("second"))  # waits for the child's commit
    waited = time.monotonic() - start
    assert child.stdout.readline() == "committed\n" and child.wait(30) == 0
    assert waited > 0.3, f"the add did not wait for the other process's transaction ({waited:.2f} s)"
    with pytest.raises(TooManyVoicesError):
        store.add(_new("third"))
    assert [v.name for v in store.list()] == ["first", "second"]
    assert store.voice_bytes("first") == b"blob-first"


def test_an_exception_inside_the_transaction_rolls_the_voice_back(tmp_path):
    def fail():
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        VoiceStore(tmp_path, in_transaction=fail).add(_new("rolled-back"))
    store = VoiceStore(tmp_path)
    assert store.list() == [] and store.voice_bytes("rolled-back") is None
    store.add(_new("rolled-back"))  # the name is free and the write lock released


def test_a_voice_keeps_seconds_created_and_info_through_a_file_and_bytes(tmp_path):
    info = {"model": "tts-base", "size": "1.7B"}
    voice = Voice(torch.ones(16), seconds=2.75, created=1_700_000_000.125, info=info)
    voice.save(tmp_path / "v.safetensors")
    for back in (Voice.load(tmp_path / "v.safetensors"), Voice.from_bytes(voice.to_bytes())):
        assert (back.seconds, back.created, back.info) == (2.75, 1_700_000_000.125, info)

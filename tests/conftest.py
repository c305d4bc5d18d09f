import os

import pytest
import torch

# One torch thread per test process, and for the servers the tests start as subprocesses too: under
# pytest-xdist (`-n 2`) the workers then share the cores instead of oversubscribing them, and serial runs
# compute as `-n 2` runs do. That matters where a test compares the bytes of two engines of one process: an
# in-process server's engine thread keeps the thread count it started with, while `OmniPipeline` applies
# the thread rule (one thread for a tiny model), and float sums split over other thread counts round
# differently. Results never depend on the core count, only on the thread count being the same.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# Adaptive drafting measures its step costs in the test's own process (and its servers'): costs an earlier run
# kept on disk would make a test's k depend on that run; tests/test_adaptive_drafting.py turns the cache on.
os.environ["OMNIMTP_DRAFT_COST_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _seed_global_rng():
    """Every test starts from the same global RNG state, so failures reproduce."""
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def checked_realtime_events(monkeypatch):
    """Every event a `/v1/realtime` session of the test sends is checked against the `openai` package's GA
    server event models (realtime_contract.py); the test fails on the first that is not one."""
    from realtime_contract import check_server_event

    from omnimtp.server.websocket import Session

    failures: list[str] = []
    send = Session.send

    async def checked_send(self, event: dict) -> bool:
        if self.route == "/v1/realtime":
            try:
                check_server_event(event if "event_id" in event else {"event_id": "event_checked", **event})
            except ValueError as exc:
                failures.append(str(exc))
        return await send(self, event)

    monkeypatch.setattr(Session, "send", checked_send)
    yield
    assert not failures, failures[0]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny-model ops are too small to split across threads; on a shared CPU the threads only contend.

    Use per module with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)



# The fast subset, `python -m pytest -m "not slow"` (about 100 s of CPU): pure pieces, small parity
# checks and the README's commands. Every other file (servers, Ray, training, statistical checks, fuzzing,
# compiled kernels, full parity runs: tens of seconds each) is marked `slow`, a new file too until it is
# listed here.
FAST_FILES = {
    "test_codec_streaming.py",
    "test_demo_model.py",
    "test_exports.py",
    "test_handoff.py",
    "test_handoff_stream.py",
    "test_media.py",
    "test_packed_decoder.py",
    "test_qwen2_5_talker_inputs.py",
    "test_quantized_spec.py",
    "test_readme.py",
    "test_rejection.py",
    "test_runtime.py",
    "test_spec_cli.py",
    "test_text_segments.py",
    "test_tokenizer.py",
    "test_voice_store.py",
}


# With `-n 2 --dist loadgroup` (pyproject's addopts choose loadgroup) a file's tests stay on one worker, so
# its module-scoped servers and models are built once; the files that start a local Ray instance share one
# group, so that two Ray instances never run at once.
RAY_FILES = {"test_ray.py", "test_signals.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name not in FAST_FILES:
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xdist_group("ray" if item.path.name in RAY_FILES else item.path.name))


# The clients of a module's `server` fixture (the base URL of a running server), for the files that start one.
@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client on the module's server."""
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    """An httpx client on the module's server."""
    import httpx

    with httpx.Client(base_url=server, timeout=120) as c:
        yield c

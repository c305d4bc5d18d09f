"""What one refused request costs the server: CPU seconds on the event loop's thread (all of it holding the GIL, so
the engine thread waits for it) and on its worker threads, per request refused with 429 `queue_full` on each route.

A real server (the embedded tiny Qwen3-Omni, uvicorn in a thread of this process) whose queue is full and whose
engine is paused (it holds one waiting request and takes no step, so only the refusals run); a client in another
process sends `--requests` requests one after another on one keep-alive connection (for the Realtime API: the
`response.create` events of one session, each answered by an `error` event). Each thread's CPU time is read from
its own clock (`time.pthread_getcpuclockid`). The refusals' pace (`omnimtp.server.guard.RefusalPace`) is lifted
here: this measures what one refusal costs, not how many a second the server answers. `floor` is a request for an
unknown path (404, a GET without a body): what any request costs uvicorn and the middleware before a route runs.

    python benchmarks/refusal_cost.py
    python benchmarks/refusal_cost.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_harness import pause_with_full_queue, running_server, start_flood  # noqa: E402

from omnimtp.families.qwen3_omni import Qwen3OmniFamily  # noqa: E402
from omnimtp.sampling import SamplingParams  # noqa: E402
from omnimtp.server.app import create_app  # noqa: E402
from omnimtp.server.requests import EngineRequest  # noqa: E402
from omnimtp.server.scheduler import Engine  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "def parse(text): return the words of the text, one a line"}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
        "max_tokens": 24}
SPEECH = {"input": "Hello there, this is a stream of speech that has to play without a gap.", "voice": "ethan",
          "response_format": "pcm"}
ROUTES = {"floor": ("/v1/unknown", None), "chat": ("/v1/chat/completions", CHAT),
          "speech": ("/v1/audio/speech", SPEECH), "realtime": ("/v1/realtime", None)}

# The realtime client: N response.create events in one session, each answered by an error event (the other routes'
# client is the tests' `FLOOD_CLIENT`).
_REALTIME_CLIENT = r"""
import json, sys
from urllib.parse import urlparse
from websockets.sync.client import connect
url, n, expected = urlparse(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with connect(f"ws://{url.hostname}:{url.port}/v1/realtime?model=tiny") as ws:
    assert json.loads(ws.recv())["type"] == "session.created"
    ws.send(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": "def parse(text): the words, one a line"}]}}))
    assert json.loads(ws.recv())["type"] == "conversation.item.added"
    ws.recv()  # conversation.item.done
    sys.stdout.write("ready\n"); sys.stdout.flush(); sys.stdin.readline()
    for _ in range(n):
        ws.send('{"type": "response.create"}')
        event = json.loads(ws.recv())
        assert event["type"] == "error" and event["error"]["code"] == expected, event
print(n)
"""


def thread_cpu_s() -> dict[int, float]:
    """{thread ident: CPU seconds} of every live thread of this process."""
    times = {}
    for thread in threading.enumerate():
        try:
            times[thread.ident] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):  # it ended meanwhile
            pass
    return times


def measure(url: str, route: str, num_requests: int, loop_ident: int) -> dict:
    path, body = ROUTES[route]
    if route == "realtime":
        client = subprocess.Popen([sys.executable, "-c", _REALTIME_CLIENT, url, str(num_requests), "queue_full"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "ready"
    else:
        client = start_flood(url, path, body, n=num_requests, expected="404" if route == "floor" else "429")
    before, started = thread_cpu_s(), time.perf_counter()
    out, _ = client.communicate("go\n", timeout=600)
    wall_s, after = time.perf_counter() - started, thread_cpu_s()
    if client.returncode != 0 or out.strip() != str(num_requests):
        raise RuntimeError(f"{route}: the client failed")
    me = threading.get_ident()
    loop_s = after.get(loop_ident, 0.0) - before.get(loop_ident, 0.0)
    others_s = sum(after[t] - before.get(t, 0.0) for t in after if t not in (loop_ident, me))
    return {"route": route, "requests": num_requests, "loop_us": 1e6 * loop_s / num_requests,
            "workers_us": 1e6 * others_s / num_requests, "wall_us": 1e6 * wall_s / num_requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="refused requests per route")
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    parser.add_argument("--quick", action="store_true", help="50 requests a route (a check that the script runs)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    num_requests = 50 if args.quick else args.requests
    import torch

    torch.set_num_threads(1)
    engine = Engine(Qwen3OmniFamily.tiny(0), model_id="tiny", max_batch_size=1, max_frames=40, admission=True)
    app = create_app(engine, max_queue=1)
    app.state.serving.refusal_pace.rate = float("inf")  # every refusal answered at once: what one costs
    results = []
    with running_server(app) as url:
        server_thread = next(t for t in threading.enumerate() if t.name == "uvicorn-test")
        pause_with_full_queue(engine, EngineRequest(
            messages=(("user", "Hi"),), speak_text=None, speaker=None, sampling=SamplingParams(temperature=0.0),
            seed=1, max_new_tokens=4))
        for route in args.routes:
            measure(url, route, 10, server_thread.ident)  # warm: first-call costs
            result = measure(url, route, num_requests, server_thread.ident)
            results.append(result)
            print(f"{route:9s} {result['requests']} requests: event loop {result['loop_us']:7.1f} us, worker threads "
                  f"{result['workers_us']:7.1f} us, wall {result['wall_us']:7.1f} us a refused request", flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}, out, indent=2)


if __name__ == "__main__":
    main()

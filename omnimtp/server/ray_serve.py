"""`omnimtp serve --replicas N`: the server as a Ray Serve deployment of independent engines.

Each replica is one Ray actor running what `omnimtp serve` runs in one process: an `Engine` with its
own engine thread and continuous batching, behind the same FastAPI app (`create_app`: every route,
streamed audio and SSE, OpenAI error bodies, the API key, the limits). Ray Serve's proxy takes the
HTTP connections and its router spreads requests over the replicas (power of two choices on their
ongoing requests); the controller restarts a replica that dies and, with `--min-replicas` /
`--max-replicas`, adds and removes replicas to keep about `--target-ongoing-requests` on each.

What the deployment changes:

    /health    the whole deployment's readiness: 200 {"status": "ok", "replicas": {...}} only while
               every replica is running (a replica reports started once its engine serves; a compiled
               predictor warms up beside it); 503 "loading" while one starts or restarts
    /metrics   every replica's Prometheus samples in one scrape, each labelled replica="<id>"
               (`MetricsHub`: replicas push a snapshot every second; a removed replica's last one stays,
               so its counters never go back); sum over the label for the deployment's totals
    shutdown   SIGINT / SIGTERM deletes the application: each replica stops taking requests, finishes
               its ongoing ones within --timeout-graceful-shutdown, then its engine stops
    WebSockets /v1/realtime and /v1/audio/speech/stream pass through Serve's proxy; a session is one
               ongoing request, on the replica its upgrade reached, for its whole life; --max-sessions
               is each replica's (`deployment_options` makes room for them in max_ongoing_requests)
    replica    every response names its replica in the X-Omnimtp-Replica header (a WebSocket's upgrade)

Serve's proxy, not omnimtp's uvicorn config, speaks HTTP here: --timeout-keep-alive applies, the
headers timeout (--timeout-headers) does not; the body timeout and every limit are the app's and apply.

A Ray cluster (`--ray-address`, or a KubeRay RayService with `omnimtp.server.cli:app_builder` as its import path; see
deploy/) needs omnimtp installed on every node and the model directory at the same path on each (shared
storage). Ray is an optional extra: `pip install 'omnimtp[ray]'`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from omnimtp.argtypes import add_verbose_argument, non_negative_float, positive_float, positive_int
from omnimtp.console import interrupt_on_signals, signals_ignored, stopped_by

APP_NAME = "omnimtp"
DEPLOYMENT_NAME = "OmniReplica"
INSTALL_HINT = "pip install 'omnimtp[ray]'"
_METRICS_PUSH_S = 1.0
# Ongoing requests a replica takes besides its engine's batch and queue: /health and /metrics scrapes.
_CONTROL_SLOTS = 4
# The WebSocket routes (/v1/realtime, /v1/audio/speech/stream): an open session is one ongoing request for
# Serve for its whole life, and a replica holds up to --max-sessions of them on each route.
_NUM_WEBSOCKET_ROUTES = 2
# Every response of a replica names it (HTTP responses, WebSocket accepts and refusals).
REPLICA_HEADER = b"x-omnimtp-replica"

logger = logging.getLogger("omnimtp.server")


def import_serve():
    """`ray.serve`, or a RuntimeError that says how to install it."""
    try:
        from ray import serve
    except ImportError as exc:
        raise RuntimeError(f"Ray Serve is not installed ({exc}); install it with: {INSTALL_HINT}") from None
    return serve


# -- the command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve`'s Ray Serve flags. None of them given: one process, Ray is not imported."""
    group = parser.add_argument_group(
        "Ray Serve", f"run the server as a Ray Serve deployment of independent engines (needs {INSTALL_HINT})")
    group.add_argument("--replicas", type=positive_int, metavar="N",
                       help="replicas, each an engine with its own continuous batching; with --min-replicas / "
                       "--max-replicas, the number it starts with")
    group.add_argument("--min-replicas", type=positive_int, metavar="N",
                       help="autoscale: the fewest replicas (default 1 with --max-replicas)")
    group.add_argument("--max-replicas", type=positive_int, metavar="N",
                       help="autoscale: the most replicas (default --min-replicas)")
    group.add_argument("--target-ongoing-requests", type=positive_float, metavar="R",
                       help="autoscale: ongoing requests per replica Serve aims for (default --max-batch-size)")
    group.add_argument("--ray-address", metavar="ADDR",
                       help="the Ray cluster to deploy on (e.g. ray://head:10001 or head:6379); default: start a "
                       "local Ray instance")
    group.add_argument("--num-cpus-per-replica", type=non_negative_float, default=1.0, metavar="C",
                       help="CPUs Ray reserves for each replica (default %(default)g; fractions allowed)")
    group.add_argument("--num-gpus-per-replica", type=non_negative_float, default=0.0, metavar="G",
                       help="GPUs Ray reserves for each replica (default %(default)g)")
    add_verbose_argument(group)


def is_requested(args: argparse.Namespace) -> bool:
    return args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None


def deployment_options(args: argparse.Namespace) -> dict:
    """`serve.deployment` options of `serve`'s arguments; ValueError naming the flag.

    A replica takes up to max_batch_size + max_queue requests, max_sessions open WebSocket sessions on each
    WebSocket route and a few scrapes, so that a replica's own bounds (its queue, its session limit), not
    Serve's router, decide when a request or an upgrade gets 429: the router never holds a request back
    behind a replica's idle sessions."""
    autoscale = args.min_replicas is not None or args.max_replicas is not None
    if args.target_ongoing_requests is not None and not autoscale:
        raise ValueError("--target-ongoing-requests needs --min-replicas or --max-replicas (autoscaling)")
    options = {
        "max_ongoing_requests": (args.max_batch_size + args.max_queue + _NUM_WEBSOCKET_ROUTES * args.max_sessions
                                 + _CONTROL_SLOTS),
        "graceful_shutdown_timeout_s": args.timeout_graceful_shutdown,
        "ray_actor_options": {"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica},
        "logging_config": serve_logging(getattr(args, "verbose", False)),
    }
    if not autoscale:
        options["num_replicas"] = args.replicas
        return options
    min_replicas = 1 if args.min_replicas is None else args.min_replicas
    max_replicas = max(min_replicas, args.max_replicas or min_replicas)
    if args.max_replicas is not None and args.max_replicas < min_replicas:
        raise ValueError(f"--max-replicas ({args.max_replicas}) is below --min-replicas ({min_replicas})")
    initial = min_replicas if args.replicas is None else args.replicas
    if not min_replicas <= initial <= max_replicas:
        raise ValueError(f"--replicas ({initial}) must be within --min-replicas ({min_replicas}) and "
                         f"--max-replicas ({max_replicas}) when autoscaling")
    options["autoscaling_config"] = {
        "min_replicas": min_replicas, "max_replicas": max_replicas, "initial_replicas": initial,
        "target_ongoing_requests": args.target_ongoing_requests or float(args.max_batch_size),
    }
    return options


# -- the deployment -----------------------------------------------------------------------------------


class OmniReplica:
    """One replica: the engine and app of `serve`'s arguments (`build_app`), wrapped by `ReplicaApp`.
    Serve calls `__serve_build_asgi_app__` after the constructor (`serve.ingress()` without an app)."""

    def __init__(self, serve_args: dict):
        import torch

        from omnimtp.console import quiet_expected_warnings
        from omnimtp.runtime.device import build_in_passing_thread
        from omnimtp.server.build import build_app

        quiet_expected_warnings()

        def build():
            # Torch uses the CPUs Ray reserved for the replica (at least one thread), not the whole node's.
            torch.set_num_threads(max(1, int(serve_args["num_cpus_per_replica"])))
            return build_app(argparse.Namespace(**serve_args))

        # as `serve` does: the engine thread alone runs the model (`build_in_passing_thread`)
        self.engine, self.server_app = build_in_passing_thread(build)

    def __serve_build_asgi_app__(self):
        serve = import_serve()
        context = serve.get_replica_context()
        return ReplicaApp(self.server_app, self.engine, app_name=context.app_name, replica_id=context.replica_tag)


def application(args: argparse.Namespace):
    """The Serve application of `serve`'s parsed arguments (`serve.run` takes it)."""
    serve = import_serve()
    options = deployment_options(args)
    replica = serve.deployment(serve.ingress()(OmniReplica), name=DEPLOYMENT_NAME, **options)
    return replica.bind(vars(args))


class ReplicaApp:
    """The ASGI app of one replica: `app` (from `create_app`) for every route but /health and /metrics,
    which speak for the whole deployment (see the module docstring). Its lifespan reports started only
    once the engine serves."""

    def __init__(self, app, engine, *, app_name: str, replica_id: str):
        self.app = app
        self.engine = engine
        self.app_name = app_name
        self.replica_id = replica_id
        self.metrics = app.state.metrics
        self.hub = None
        self._pusher = None  # the asyncio task that pushes metrics, once started

    async def __call__(self, scope, receive, send):
        from omnimtp.server.guard import route_path

        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._started_when_serving(send))
            return
        send = self._naming_replica(send)
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            path = route_path(scope)
            if path == "/health":
                await (await self.health())(scope, receive, send)
                return
            if path == "/metrics":
                await (await self.all_metrics())(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _naming_replica(self, send):
        """`send` with the `REPLICA_HEADER` added to the response's headers: a client (or a test) sees which
        replica answered, and that a WebSocket session's replica is the one its upgrade reached."""
        header = (REPLICA_HEADER, self.replica_id.encode("latin-1"))

        async def send_named(message):
            if message["type"] in ("http.response.start", "websocket.accept", "websocket.http.response.start"):
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        return send_named

    def _started_when_serving(self, send):
        import asyncio

        async def send_when_serving(message):
            if message["type"] == "lifespan.startup.complete":
                while self.engine.is_running and not self.engine.is_ready:
                    await asyncio.sleep(0.05)
                if not self.engine.is_running:
                    message = {"type": "lifespan.startup.failed", "message": "the engine stopped while warming up"}
                else:
                    self._start_metrics_pusher()
            elif message["type"] == "lifespan.shutdown.complete" and self._pusher is not None:
                self._pusher.cancel()
            await send(message)

        return send_when_serving

    async def health(self):
        import asyncio

        from fastapi.responses import JSONResponse
        from ray.serve.schema import DeploymentStatus

        if not self.engine.is_running:
            return JSONResponse({"status": "stopping"}, status_code=503)
        serve = import_serve()
        status = await asyncio.to_thread(serve.status)
        application = status.applications.get(self.app_name)
        deployment = None if application is None else application.deployments.get(DEPLOYMENT_NAME)
        states = {} if deployment is None else dict(deployment.replica_states)
        replicas = {"running": states.get("RUNNING", 0), "total": sum(states.values())}
        is_ready = (deployment is not None and deployment.status == DeploymentStatus.HEALTHY
                    and 0 < replicas["running"] == replicas["total"])
        if not is_ready:
            return JSONResponse({"status": "loading", "replicas": replicas}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": replicas})

    async def all_metrics(self):
        from fastapi.responses import Response

        from omnimtp.server.errors import APIError

        try:
            hub = self._metrics_hub()
            await hub.put.remote(self.replica_id, self.metrics.render())
            snapshots = await hub.snapshots.remote()
        except Exception as exc:  # the hub's actor is gone or unreachable: say so, never a traceback
            logger.exception("metrics hub unreachable")
            return APIError(503, f"the replicas' metrics are unavailable: {type(exc).__name__}",
                            type="server_error").response()
        return Response(merge_metrics(snapshots), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _metrics_hub(self):
        if self.hub is None:
            import ray

            hub = ray.remote(num_cpus=0)(MetricsHub)
            self.hub = hub.options(name=f"{self.app_name}-metrics", namespace="omnimtp", get_if_exists=True,
                                   lifetime="detached").remote()
        return self.hub

    def _start_metrics_pusher(self) -> None:
        import asyncio

        async def push():
            while True:
                try:
                    await self._metrics_hub().put.remote(self.replica_id, self.metrics.render())
                except Exception:  # a scrape reports it; the next push tries again
                    self.hub = None
                await asyncio.sleep(_METRICS_PUSH_S)

        self._pusher = asyncio.get_running_loop().create_task(push())


class MetricsHub:
    """A named Ray actor holding each replica's latest Prometheus text, by replica id."""

    def __init__(self):
        self._snapshots: dict[str, bytes] = {}

    def put(self, replica_id: str, text: bytes) -> None:
        self._snapshots[replica_id] = text

    def snapshots(self) -> dict[str, bytes]:
        return dict(self._snapshots)


def merge_metrics(snapshots: dict[str, bytes]) -> bytes:
    """One Prometheus text of several registries' texts (by replica id): each family once, each sample
    with a `replica` label.

        {"a": b'x_total 1.0', "b": b'x_total 2.0'} → x_total{replica="a"} 1.0, x_total{replica="b"} 2.0"""
    from prometheus_client import Metric, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica_id in sorted(snapshots):
        for family in text_string_to_metric_families(snapshots[replica_id].decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica_id}, sample.value,
                                  sample.timestamp, sample.exemplar)

    class _Families:
        def collect(self):
            return list(families.values())

    return generate_latest(_Families())


# -- `omnimtp serve --replicas N` ---------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Deploy on a local Ray instance (started here, stopped at exit) or the cluster at --ray-address,
    serve until SIGINT / SIGTERM, then delete the application (each replica drains). A signal while the
    replicas deploy stops the deploy; the local instance is shut down either way, leaving no process."""
    try:
        options = deployment_options(args)
        serve = import_serve()
    except (ValueError, RuntimeError) as exc:
        print(f"omnimtp serve: error: {exc}", file=sys.stderr)
        return 2
    import ray

    is_local = args.ray_address is None
    is_deploying = False
    try:
        init_ray(args.ray_address, verbose=args.verbose)
        interrupt_on_signals()  # Ray's handlers replaced: Ctrl-C and SIGTERM stop a deploy under way too
        if is_local:
            needed = _replicas_at_start(options) * args.num_cpus_per_replica
            available = ray.cluster_resources().get("CPU", 0.0)
            if needed > available:
                print(f"omnimtp serve: error: {_replicas_at_start(options)} replicas × {args.num_cpus_per_replica:g} "
                      f"CPUs need {needed:g} CPUs; this machine has {available:g}: lower --num-cpus-per-replica "
                      "(fractions are allowed) or --replicas", file=sys.stderr)
                return 2
        print(f"omnimtp: deploying {_describe(options)} on Ray Serve (Ctrl-C stops)", flush=True)
        is_deploying = True
        deploy(args)
        print(f"omnimtp: serving on http://{args.host}:{args.port}/v1 with Ray Serve "
              f"({_describe(options)})", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt as exc:
        print(f"omnimtp: stopping ({stopped_by(exc).name})" + (": draining the replicas" if is_deploying else ""),
              flush=True)
    finally:
        if is_deploying:
            try:
                serve.delete(APP_NAME)  # each replica finishes its requests within --timeout-graceful-shutdown
                _kill_metrics_hub(ray)
            except KeyboardInterrupt:  # a second Ctrl-C: no drain
                pass
            except Exception as exc:  # stopped before Serve was up: nothing to delete
                logger.warning("deleting the application: %s: %s", type(exc).__name__, exc)
        with signals_ignored():  # Ray's processes must go, whatever arrives now
            if is_local and is_deploying:
                serve.shutdown()
            ray.shutdown()
    return 0


def deploy(args: argparse.Namespace) -> None:
    """Start Serve's proxy on --host/--port (on the connected Ray cluster) and run the application;
    returns once every replica is running."""
    serve = import_serve()
    serve.start(http_options={"host": args.host, "port": args.port, "keep_alive_timeout_s": args.timeout_keep_alive},
                logging_config=serve_logging(args.verbose))
    serve.run(application(args), name=APP_NAME, route_prefix="/", blocking=False)


def init_ray(address: str | None, *, verbose: bool = False, **local_options) -> None:
    """Connect to the Ray cluster at `address`, or start a local instance (on the loopback address, no
    dashboard; local_options: more `ray.init` arguments, e.g. num_cpus) whose workers import the
    omnimtp this process runs (a checkout, or the installed one). A cluster's nodes need omnimtp installed.
    Ray logs its warnings and errors only, unless `verbose` (`quiet_ray` here, `quiet_ray_worker` in every
    worker process Ray starts for this job: Serve's controller, proxies and replicas, Ray Data's actors)."""
    import ray

    level = logging.INFO if verbose else logging.WARNING
    runtime_env = {} if verbose else {"worker_process_setup_hook": f"{__name__}.quiet_ray_worker"}
    if not verbose:
        quiet_ray()
    if address is not None:
        ray.init(address=address, logging_level=level, runtime_env=runtime_env)
        return
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=level,
             runtime_env={**runtime_env, "env_vars": {"PYTHONPATH": package_root}}, **local_options)


def serve_logging(verbose: bool) -> dict:
    """Serve's `logging_config` for its controller, proxy and replicas: INFO with each request's access log
    when `verbose`, else warnings and errors only."""
    return {"log_level": "INFO" if verbose else "WARNING", "enable_access_log": verbose}


# What Ray says at every start that a user of these commands need not read: a local instance made with token
# authentication on (the secure default; the warning that it is *off* is kept), and Ray Data's note that
# progress bars are off (`omnimtp batch` draws its own).
_RAY_EXPECTED = {
    "ray._private.authentication.authentication_token_setup": "Token authentication is enabled for this Ray cluster",
    "ray.data._internal.progress": "Progress bars disabled.",
}
# What Ray's workers say that is expected of this engine on a CPU: Serve's router (in each proxy) asks the
# replicas how many requests they hold and waits 0.1 s for the answer; a replica in the middle of a model step
# on a busy CPU often answers later, and the router goes on as designed (that replica's count unknown for this
# choice, a doubled deadline the next time), warning each time. The deadline is left as it is: a longer one
# would hold every request behind a slow replica's answer.
_RAY_WORKER_EXPECTED = {
    "ray.serve": "Failed to get queue length from ",
}


class _ExpectedRayNotice(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _filter_expected(expected: dict[str, str]) -> None:
    for name, prefix in expected.items():
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedRayNotice) and f.prefix == prefix for f in logger_.filters):
            logger_.addFilter(_ExpectedRayNotice(prefix))


def quiet_ray() -> None:
    """Ray's expected start-up notices (above) filtered, and the driver's Ray Serve and Ray Data loggers at
    WARNING (each sets its own level; `ray.init`'s logging_level does not reach them). Idempotent."""
    _filter_expected(_RAY_EXPECTED)
    for name in ("ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)


def quiet_ray_worker() -> None:
    """Run by Ray in each worker process it starts for a command without --verbose (runtime_env's
    `worker_process_setup_hook`, before the process becomes Serve's proxy, a replica or an actor): the expected
    worker notices (`_RAY_WORKER_EXPECTED`) filtered from their loggers. Serve's own logging set-up replaces a
    logger's handlers and level, not its filters; every other warning and error is still printed. Idempotent."""
    _filter_expected(_RAY_WORKER_EXPECTED)


def _replicas_at_start(options: dict) -> int:
    autoscaling = options.get("autoscaling_config")
    return options["num_replicas"] if autoscaling is None else autoscaling["initial_replicas"]


def _describe(options: dict) -> str:
    autoscaling = options.get("autoscaling_config")
    if autoscaling is None:
        return f"{options['num_replicas']} replicas"
    return (f"{autoscaling['initial_replicas']} replicas, autoscaling {autoscaling['min_replicas']}–"
            f"{autoscaling['max_replicas']} at {autoscaling['target_ongoing_requests']:g} ongoing requests each")


def _kill_metrics_hub(ray) -> None:
    try:
        ray.kill(ray.get_actor(f"{APP_NAME}-metrics", namespace="omnimtp"))
    except ValueError:  # never scraped nor pushed: no hub
        pass

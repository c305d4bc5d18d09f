"""`serve --replicas` and `batch` pieces that need no Ray instance: flags → Serve options, the metrics
merge, the prompt file and resume bookkeeping, and that one-process `serve` never imports Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnimtp.batch import BatchInputError, finished_ids, read_prompts
from omnimtp.cli import build_parser, main
from omnimtp.server import ray_serve
from omnimtp.server.cli import app_builder
from omnimtp.server.guard import route_path
from omnimtp.server.metrics import ServerMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _options(*flags):
    return ray_serve.deployment_options(build_parser().parse_args(["serve", *flags]))


def test_fixed_replicas_take_a_whole_batch_queue_and_sessions_each():
    options = _options("--replicas", "3", "--num-cpus-per-replica", "0.5", "--num-gpus-per-replica", "1",
                       "--max-batch-size", "8", "--max-queue", "32", "--max-sessions", "5")
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    # an open WebSocket session is an ongoing request: --max-sessions on each of the two WebSocket routes
    assert options["max_ongoing_requests"] == 8 + 32 + 2 * 5 + 4
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 1.0}
    assert options["graceful_shutdown_timeout_s"] == 30.0


def test_ray_logs_warnings_only_unless_verbose():
    """Serve's controller, proxy and replicas log at WARNING without their access log unless --verbose; the
    expected start-up notices are dropped (the warning that token authentication is *off* is not)."""
    import logging

    assert _options("--replicas", "1")["logging_config"] == {"log_level": "WARNING", "enable_access_log": False}
    assert _options("--replicas", "1", "--verbose")["logging_config"] == {"log_level": "INFO",
                                                                          "enable_access_log": True}
    assert build_parser().parse_args(["batch", "--input", "a", "--output", "b", "--verbose"]).verbose
    ray_serve.quiet_ray()
    ray_serve.quiet_ray()  # idempotent
    token = logging.getLogger("ray._private.authentication.authentication_token_setup")
    assert len(token.filters) == 1
    progress = logging.getLogger("ray.data._internal.progress")
    records = []  # on the loggers themselves: once Ray has set up its logging, "ray" no longer propagates to root
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    for logger in (token, progress):
        logger.addHandler(handler)
    try:
        token.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        token.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
        progress.warning("Progress bars disabled. To enable, set ...")
    finally:
        for logger in (token, progress):
            logger.removeHandler(handler)
    assert [record.getMessage()[:40] for record in records] == ["Token authentication is disabled for thi"]
    assert logging.getLogger("ray.serve").level == logging.WARNING == logging.getLogger("ray.data").level


def test_ray_workers_drop_the_routers_expected_deadline_warning_unless_verbose(monkeypatch):
    """Without --verbose every Ray worker of the job (Serve's proxy among them: tests/test_ray.py) runs
    `quiet_ray_worker`, which drops the router's "Failed to get queue length" warning, a replica answering
    later than 0.1 s in the middle of a step on a busy CPU, and nothing else; the deadline stays Ray's."""
    import logging

    import ray

    seen = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(kwargs))
    ray_serve.init_ray(None)
    ray_serve.init_ray("ray://cluster:10001")
    ray_serve.init_ray(None, verbose=True)
    hook = "omnimtp.server.ray_serve.quiet_ray_worker"
    assert [kwargs["runtime_env"].get("worker_process_setup_hook") for kwargs in seen] == [hook, hook, None]
    assert all("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S" not in kwargs["runtime_env"].get("env_vars", {})
               for kwargs in seen)

    ray_serve.quiet_ray_worker()
    ray_serve.quiet_ray_worker()  # idempotent
    serve_logger = logging.getLogger("ray.serve")
    assert sum(isinstance(f, ray_serve._ExpectedRayNotice) for f in serve_logger.filters) == 1
    kept = []
    handler = logging.Handler()
    handler.emit = kept.append
    serve_logger.addHandler(handler)
    try:
        serve_logger.warning("Failed to get queue length from Replica(id='x', deployment='omnimtp') within 0.1s. "
                             "If this happens repeatedly ...")
        serve_logger.warning("Failed to fetch queue length for Replica(id='x'). Replica is temporarily unavailable.")
    finally:
        serve_logger.removeHandler(handler)
    assert [record.getMessage()[:30] for record in kept] == ["Failed to fetch queue length f"]


def test_app_builder_reads_a_serve_config_as_serve_flags(monkeypatch):
    # a RayService's `args`: each key a `serve` flag without its dashes; the application gets what the CLI parses
    monkeypatch.setattr(ray_serve, "application", lambda args: args)
    args = app_builder({"model": "tiny-tts", "max_batch_size": 4, "eager": True, "served_model_name": ["a", "b"],
                        "voices_dir": None})
    expected = build_parser().parse_args(["serve", "--model", "tiny-tts", "--max-batch-size", "4", "--eager",
                                          "--served-model-name", "a", "--served-model-name", "b"])
    assert {key: value for key, value in vars(args).items() if key not in ("replicas", "handler", "command")} == {
        key: value for key, value in vars(expected).items() if key not in ("replicas", "handler", "command")}
    assert args.replicas == 1  # the config's deployment section sets the count
    with pytest.raises(SystemExit):
        app_builder({"max_batch_size": 0})


def test_the_rayservice_deployment_takes_what_its_args_need(monkeypatch):
    # deploy/rayservice.yaml's deployment section overrides the options the code would set: they must agree
    import yaml

    monkeypatch.setattr(ray_serve, "application", lambda args: args)
    with open(os.path.join(ROOT, "deploy", "rayservice.yaml")) as file:
        (application,) = yaml.safe_load(yaml.safe_load(file)["spec"]["serveConfigV2"])["applications"]
    (deployment,) = application["deployments"]
    options = ray_serve.deployment_options(app_builder(application["args"]))
    assert deployment["max_ongoing_requests"] == options["max_ongoing_requests"]
    assert deployment["graceful_shutdown_timeout_s"] == options["graceful_shutdown_timeout_s"]


def test_autoscaling_options():
    options = _options("--min-replicas", "1", "--max-replicas", "4", "--replicas", "2", "--max-batch-size", "8")
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                             "target_ongoing_requests": 8.0}
    assert _options("--max-replicas", "3", "--target-ongoing-requests", "5")["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 3, "initial_replicas": 1, "target_ongoing_requests": 5.0}


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2", "--target-ongoing-requests", "4"], "--target-ongoing-requests needs"),
    (["--min-replicas", "3", "--max-replicas", "2"], "below --min-replicas"),
    (["--min-replicas", "1", "--max-replicas", "2", "--replicas", "5"], "must be within"),
])
def test_bad_scaling_is_refused_before_ray_starts(flags, message, capsys):
    with pytest.raises(ValueError, match=message):
        _options(*flags)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--replicas=0", "--num-cpus-per-replica=-1", "--target-ongoing-requests=nan"])
def test_bad_flag_values_are_usage_errors(flag):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag])


def test_missing_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match=r"pip install 'omnimtp\[ray\]'"):
        ray_serve.import_serve()


def test_one_process_serve_never_imports_ray():
    code = ("import sys; from omnimtp.cli import build_parser; from omnimtp.server.build import build_app; "
            "build_app(build_parser().parse_args(['serve', '--eager'])); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_routes_and_the_api_key_see_the_path_below_a_route_prefix():
    # Serve mounts an application with a route prefix at root_path and passes the whole path
    assert route_path({"path": "/tts/v1/models", "root_path": "/tts"}) == "/v1/models"
    assert route_path({"path": "/tts", "root_path": "/tts"}) == "/"
    assert route_path({"path": "/ttsx/v1/models", "root_path": "/tts"}) == "/ttsx/v1/models"
    assert route_path({"path": "/v1/models", "root_path": ""}) == route_path({"path": "/v1/models"}) == "/v1/models"


def test_merge_metrics_labels_every_sample_by_replica():
    first, second = ServerMetrics(), ServerMetrics()
    first.requests.labels(route="/v1/models", status="200").inc()
    second.requests.labels(route="/v1/models", status="200").inc(2)
    second.time_to_first_audio.observe(0.3)
    merged = ray_serve.merge_metrics({"b": second.render(), "a": first.render()}).decode()
    families = {family.name: family for family in text_string_to_metric_families(merged)}
    requests = {s.labels["replica"]: s.value for s in families["omnimtp_requests"].samples if s.name.endswith("_total")}
    assert requests == {"a": 1.0, "b": 2.0}
    counts = {s.labels["replica"]: s.value for s in families["omnimtp_time_to_first_audio_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"a": 0.0, "b": 1.0}
    assert merged.count("# TYPE omnimtp_requests_total counter") == 1


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("line, message", [
    ("{bad", "not valid JSON"),
    ({"prompt": "hi"}, "id must be"),
    ({"id": "../x", "prompt": "hi"}, "id must be"),
    ({"id": "a"}, "exactly one of prompt and messages"),
    ({"id": "a", "prompt": " "}, "non-empty string"),
    ({"id": "a", "messages": [{"role": "user"}]}, "messages must be"),
    ({"id": "a", "prompt": "hi", "seed": 2**63}, "int64"),
    ({"id": "a", "prompt": "hi", "speed": 2}, "unknown field 'speed'"),
])
def test_bad_prompt_lines_are_named(tmp_path, line, message):
    path = _write(tmp_path / "p.jsonl", [{"id": "ok", "prompt": "fine"}, line])
    with pytest.raises(BatchInputError, match=rf"p\.jsonl:2: .*{message}"):
        read_prompts(path)


def test_duplicate_ids_are_refused(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, "", {"id": "a", "prompt": "y"}])
    with pytest.raises(BatchInputError, match="p.jsonl:3: id 'a' is also on line 1"):
        read_prompts(path)


def test_a_torn_last_result_line_is_cut_and_not_counted(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "te')
    assert finished_ids(str(tmp_path)) == {"a", "b"}
    assert results.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    assert finished_ids(str(tmp_path / "missing")) == set()


def test_batch_refuses_an_unknown_voice_before_ray_starts(tmp_path, capsys):
    path = _write(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x", "voice": "nobody"}])
    assert main(["batch", "--input", path, "--output", str(tmp_path / "out")]) == 2
    assert "unknown voice 'nobody'" in capsys.readouterr().err

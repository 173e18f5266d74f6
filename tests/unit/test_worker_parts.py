"""Worker pieces that need no queue: probe states, deadline checks, the tiny model's tokenizer."""

from __future__ import annotations

import time

from model_worker.serving.health import WorkerHealth
from model_worker.serving.intake import deadline_of


def test_probes_follow_the_worker_lifecycle():
    health = WorkerHealth(stall_seconds=60)
    assert health.status("/startupz")[0] == 503 and health.status("/readyz")[0] == 503
    health.started = True
    assert health.status("/startupz")[0] == 200 and health.status("/readyz")[0] == 200
    health.draining = True
    assert health.status("/readyz") == (503, "draining")
    assert health.status("/livez")[0] == 200
    assert health.status("/other")[0] == 404


def test_a_problem_found_while_loading_ends_start_up_and_says_why_in_readiness():
    """Weights that cannot be served: the kubelet hands over to readiness (503, the reason) and liveness (alive)
    instead of restarting the pod when the startup probe's deadline passes."""
    health = WorkerHealth(stall_seconds=0.01)
    health.report_problem(
        "weights of m v1", "gs://b/m/1: unet/x.safetensors: does not load (invalid offset) — not served"
    )
    time.sleep(0.05)
    assert health.status("/startupz")[0] == 200
    assert health.status("/readyz") == (
        503,
        "not ready: weights of m v1: gs://b/m/1: unet/x.safetensors: does not load (invalid offset) — not served",
    )
    assert health.status("/livez") == (200, "alive")  # no loop turns yet: nothing to call stalled
    health.clear_problem("weights of m v1")
    assert health.status("/readyz") == (503, "loading") and health.status("/startupz")[0] == 200


def test_the_probes_answer_utf8_text_saying_so():
    import requests

    from model_worker.serving.health import serve_health

    health = WorkerHealth(stall_seconds=60)
    health.report_problem("weights of m v1", "gs://b/m/1: x — not served")
    server = serve_health(health, 0, "127.0.0.1")
    try:
        response = requests.get(f"http://127.0.0.1:{server.server_address[1]}/readyz", timeout=5)
    finally:
        server.shutdown()
    assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert response.status_code == 503 and response.text == "not ready: weights of m v1: gs://b/m/1: x — not served"


def test_a_probe_that_left_before_its_answer_prints_no_traceback_and_other_errors_still_do(capsys):
    from model_worker.serving.health import ProbeServer

    server = ProbeServer(("127.0.0.1", 0), None)
    try:
        for gone in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "Connection reset by peer")):
            try:
                raise gone
            except OSError:
                server.handle_error(None, ("127.0.0.1", 4242))
        assert capsys.readouterr().err == ""
        try:
            raise ValueError("a real fault")
        except ValueError:
            server.handle_error(None, ("127.0.0.1", 4242))
        assert "ValueError: a real fault" in capsys.readouterr().err
    finally:
        server.server_close()


def test_a_stalled_loop_fails_liveness():
    health = WorkerHealth(stall_seconds=0.01)
    health.started = True
    time.sleep(0.05)
    assert health.status("/livez") == (503, "stalled")
    health.beat()
    assert health.status("/livez")[0] == 200


def test_deadlines_are_epoch_milliseconds_and_a_missing_one_runs_the_request():
    assert deadline_of({"deadline_ms": "1700000000000"}) == 1_700_000_000_000
    assert deadline_of({}) is None
    assert deadline_of({"deadline_ms": "soon"}) is None


def test_tiny_tokenizer_knows_prompt_words(tmp_path):
    from transformers import CLIPTokenizer

    from emulators.tiny_pipeline import build_tokenizer

    bos, eos = build_tokenizer(tmp_path)
    tokenizer = CLIPTokenizer.from_pretrained(tmp_path)
    ids = tokenizer("a lighthouse at dawn").input_ids
    assert ids[0] == bos and ids[-1] == eos
    assert tokenizer.tokenize("lighthouse") == ["lighthouse</w>"]
    assert tokenizer.unk_token_id not in ids[1:-1]

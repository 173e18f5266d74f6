"""Worker pieces that need no queue: probe states, deadline checks, the tiny model's tokenizer."""

from __future__ import annotations

import time

from model_worker.health import WorkerHealth
from model_worker.intake import deadline_of


def test_probes_follow_the_worker_lifecycle():
    health = WorkerHealth(stall_seconds=60)
    assert health.status("/startupz")[0] == 503 and health.status("/readyz")[0] == 503
    health.started = True
    assert health.status("/startupz")[0] == 200 and health.status("/readyz")[0] == 200
    health.draining = True
    assert health.status("/readyz") == (503, "draining")
    assert health.status("/livez")[0] == 200
    assert health.status("/other")[0] == 404


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

    from model_worker.tiny_pipeline import build_tokenizer

    bos, eos = build_tokenizer(tmp_path)
    tokenizer = CLIPTokenizer.from_pretrained(tmp_path)
    ids = tokenizer("a lighthouse at dawn").input_ids
    assert ids[0] == bos and ids[-1] == eos
    assert tokenizer.tokenize("lighthouse") == ["lighthouse</w>"]
    assert tokenizer.unk_token_id not in ids[1:-1]

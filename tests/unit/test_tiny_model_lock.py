"""`python -m emulators.tiny_pipeline` builds in a folder one process at a time: the suite's two stacks start
together and once built the same tiny models into one folder at once (one read a tokenizer file the other was
still writing, and its stack failed to start)."""

from __future__ import annotations

import fcntl
import sys
import threading

from emulators import tiny_pipeline


def test_a_second_build_waits_for_the_first_to_finish(tmp_path, monkeypatch):
    ran = threading.Event()
    monkeypatch.setattr(tiny_pipeline, "publish", lambda settings, out, upload: ran.set())
    monkeypatch.setattr(sys, "argv", ["tiny_pipeline", "--out", str(tmp_path)])
    with open(tmp_path / ".building.lock", "w") as first:  # another process's build under way
        fcntl.flock(first, fcntl.LOCK_EX)
        second = threading.Thread(target=tiny_pipeline.main, daemon=True)
        second.start()
        assert not ran.wait(0.5), "built while another build held the folder"
    second.join(30)
    assert ran.is_set()

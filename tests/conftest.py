"""Fixtures shared by the integration and end-to-end tests: one real local stack per test session."""

from __future__ import annotations

import base64
import io
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from emulators.stack import StackConfig, configuring_variables, down, up
from tests.port_blocks import claim_port_block

# `make test` runs the files on parallel pytest-xdist workers (`-n`, `--dist loadfile`), each with a whole stack
# of its own: every port the tests use is derived from MAAS_TEST_PORT_OFFSET, so each worker gets its own
# offset before any test module reads it (500 apart keeps every stack's port set disjoint). The session itself
# (the xdist controller, before it starts its workers, who inherit the variable) claims a free block of offsets,
# so a second `make test` in another clone on the same machine runs beside this one instead of on its ports.
if not os.environ.get("PYTEST_XDIST_WORKER") and "MAAS_TEST_PORT_OFFSET" not in os.environ:
    os.environ["MAAS_TEST_PORT_OFFSET"] = str(claim_port_block())
if (_xdist_worker := os.environ.get("PYTEST_XDIST_WORKER", "")).startswith("gw"):
    os.environ["MAAS_TEST_PORT_OFFSET"] = str(
        int(os.environ.get("MAAS_TEST_PORT_OFFSET", "10000")) + 500 * int(_xdist_worker.removeprefix("gw"))
    )

TEST_API_KEYS = ("test-key-primary", "test-key-secondary")
TEST_ADMIN_KEY = "test-admin-key"
# An adapter the tests register whose first load the stack's workers delay on purpose (a test hook): long enough
# that a base request sent during the load is answered before it ends even on a busy machine (an order the test checks).
SLOW_ADAPTER, SLOW_ADAPTER_LOAD_SECONDS = "slow-probe", 20


def stack_config(stack_dir) -> StackConfig:
    """The test suite's stack: `make up`'s, on this session's ports, with the tests' keys, hooks and fixture models."""
    return StackConfig(
        stack_dir=stack_dir,
        port_offset=int(os.environ.get("MAAS_TEST_PORT_OFFSET", "10000")),
        api_keys=",".join(TEST_API_KEYS),
        api_keys_from_env=True,
        test_fixtures=True,  # the integration and e2e tests' models (tests/models.fixtures.yaml) beside make up's
        environment={
            **configuring_variables(os.environ),
            "MAAS_ADMIN_KEYS": TEST_ADMIN_KEY,
            "MAAS_ADAPTER_LOAD_DELAY": f"{SLOW_ADAPTER}={SLOW_ADAPTER_LOAD_SECONDS}",
            # A dead API process's batches are resumed by another within seconds (the batch fault tests).
            "MAAS_BATCH_LEASE_SECONDS": "3",
            # Two suites' emulators on one loaded machine: the Pub/Sub emulator may take seconds to accept a publish.
            "MAAS_PUBLISH_TIMEOUT_SECONDS": "60",
            # A synthetic call prompted `!hold <name>` waits after its first step until the test opens its gate.
            "MAAS_HOLD_DIR": str(holds_dir(stack_dir)),
        },
    )


def holds_dir(stack_dir) -> Path:
    return Path(stack_dir) / "holds"


def open_hold(stack: StackConfig, name: str) -> None:
    """Lets a synthetic call held by a `!hold <name>` prompt go on (model_worker/serving/fault_hooks.py)."""
    directory = holds_dir(stack.stack_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).touch()


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> StackConfig:
    """The whole stack (emulators, API, workers) started through the code `make up` uses, on offset ports."""
    config = stack_config(tmp_path_factory.mktemp("stack"))
    up(config)
    saved = dict(os.environ)
    os.environ.update(config.client_env())
    yield config
    os.environ.clear()
    os.environ.update(saved)
    down(config, graceful=False)  # nothing reads it again: no drain


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Stops this process's stack after its last stack test, not at the session's end: every process runs its stack
    files before the others (tests/file_order.py), and an idle stack costs about a third of a core (its Pub/Sub
    emulator polls every waiting pull every 50 ms) that the unit tests left to run need."""
    from tests.file_order import needs_stack

    result = yield
    if nextitem is not None and needs_stack(item.nodeid) and not needs_stack(nextitem.nodeid):
        for fixturedef in item.session._fixturemanager.getfixturedefs("stack", item) or ():  # noqa: SLF001
            fixturedef.finish(item._request)  # noqa: SLF001 - its dependents first, then `down`
    return result


@pytest.fixture(scope="session")
def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TEST_API_KEYS[0]}"}


@pytest.fixture(scope="session")
def settings(stack):
    from contract.settings import Settings

    return Settings.from_env({**os.environ, **stack.client_env(), "MAAS_API_KEYS": stack.api_keys})


@pytest.fixture(scope="session")
def bigquery(settings):
    from contract import google_clients

    return google_clients.bigquery_client(settings)


def query_rows(client, sql: str, expected: int, timeout: float = 15.0) -> list[dict]:
    """Polls until at least `expected` rows match: the API writes log rows from a background thread."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [dict(row) for row in client.query(sql).result()]
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)


def wait_for(condition: Callable[[], object], what: str = "the condition", timeout: float = 120.0):
    """`condition()`'s first true value, polled; `timeout` only ends a hang (the test fails naming `what`)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.05)
    return value


def png_b64(width: int = 64, height: int = 64, noise: bool = False) -> str:
    """A PNG input image; noise does not compress, so a large one exceeds the inline payload limit."""
    from PIL import Image

    buffer = io.BytesIO()
    if noise:
        image = Image.frombytes("RGB", (width, height), os.urandom(width * height * 3))
    else:
        image = Image.new("RGB", (width, height), (200, 80, 40))
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()

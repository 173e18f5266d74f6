"""A batch store and runner against a real Redis server (the real Lua scripts), with GCS, the serving stage, Pub/Sub
and the log writer in memory: batch bookkeeping tested line by line, with the situations that matter forced."""

from __future__ import annotations

import io
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace

import pytest
import redis

from api_server.batches.lines import line_request_id
from api_server.batches.runner import BatchRunner
from api_server.batches.store import BatchStore
from api_server.core.auth import Caller
from api_server.predict.inference import PreparedRequest
from api_server.predict.schemas import PredictBody
from contract import naming
from contract.generation import GenerationParameters
from contract.messages import InferenceReply
from contract.settings import Settings
from contract.stores.results import ResultStore
from tests.unit.test_step_scheduler import CATALOG

BUCKET = "payloads"
RESULT_TTL_SECONDS = 3600


@pytest.fixture(scope="module")
def redis_server() -> Iterator[redis.Redis]:
    """A redis-server of its own on a free port, without persistence (as a restarted one that lost everything)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.02)
    try:
        yield client
    finally:
        process.terminate()
        process.wait(timeout=10)


class Blob:
    def __init__(self, bucket: Bucket, name: str) -> None:
        self.bucket, self.name = bucket, name

    def upload_from_string(self, data, content_type: str | None = None) -> None:
        self.bucket.objects[self.name] = data.encode() if isinstance(data, str) else bytes(data)

    def download_as_bytes(self) -> bytes:
        if self.name not in self.bucket.objects:
            raise FileNotFoundError(self.name)
        return self.bucket.objects[self.name]

    def download_as_text(self) -> str:
        return self.download_as_bytes().decode()

    def delete(self) -> None:
        self.bucket.objects.pop(self.name, None)

    def open(self, mode: str = "rb", chunk_size: int | None = None) -> io.BytesIO:
        return io.BytesIO(self.download_as_bytes())


class Bucket:
    """A GCS bucket in memory: what the batch code calls of one."""

    def __init__(self, name: str = BUCKET) -> None:
        self.name, self.objects = name, {}

    def blob(self, name: str) -> Blob:
        return Blob(self, name)

    def get_blob(self, name: str) -> Blob | None:
        return Blob(self, name) if name in self.objects else None

    def list_blobs(self, prefix: str = "") -> list[Blob]:
        return [Blob(self, name) for name in sorted(self.objects) if name.startswith(prefix)]


class Storage:
    def __init__(self, bucket: Bucket) -> None:
        self._bucket = bucket

    def bucket(self, name: str) -> Bucket:
        assert name == self._bucket.name
        return self._bucket


class Serving:
    """The serving stage as `validate_line` calls it: every line a request to the catalog's `sleep` model;
    `on_prepare(number)` runs as the n-th line is validated (a DELETE landing mid-slice, say)."""

    def __init__(self) -> None:
        self.prepared = 0
        self.on_prepare: Callable[[int], None] | None = None

    def model(self, name: str, request_id: str, caller: Caller):
        return CATALOG.get("sleep")

    def prepare(self, spec, body, request_id: str, caller: Caller, **options) -> PreparedRequest:
        self.prepared += 1
        if self.on_prepare is not None:
            self.on_prepare(self.prepared)
        params = GenerationParameters(seed=1, num_inference_steps=2, guidance_scale=1.0, width=64, height=64)
        predict = PredictBody.model_validate(body)
        return PreparedRequest(request_id, spec, predict, params, [None], "normal", caller)


class Inference:
    """Publishes recorded in order (request ids); `gate`, when set, holds each publish until it is set."""

    def __init__(self) -> None:
        self.published: list[str] = []
        self.gate = None

    def message(self, prepared: PreparedRequest):
        text = f'{{"request_id": "{prepared.request_id}"}}'
        return SimpleNamespace(request_id=prepared.request_id, model_dump_json=lambda: text)

    def publish(self, message, spec, deadline_ms: int, priority: str, reply_to: str | None = None) -> None:
        if self.gate is not None:
            self.gate.wait(30)
        self.published.append(message.request_id)


class Log:
    def __init__(self) -> None:
        self.rows = []

    def write(self, row) -> None:
        self.rows.append(row)

    def spool_queued(self) -> None:
        pass


class BigQuery:
    """Tables of rows (dicts, as the client's rows read), listed from a start index page by page as `tabledata.list`
    lists them; `pages` records each page's (start, rows) read."""

    def __init__(self) -> None:
        self.tables: dict[str, list[dict]] = {}
        self.pages: list[tuple[int, int]] = []
        self.fail_once_at: set[int] = set()  # page starts whose first fetch fails (a 503 after the client's retries)

    def get_table(self, table_id: str) -> SimpleNamespace:
        if table_id not in self.tables:
            raise LookupError(f"404 Not found: Table {table_id}")
        return SimpleNamespace(table_id=table_id, table_type="TABLE", schema=[])

    def list_rows(self, table, start_index: int = 0, page_size: int = 100) -> Iterator[SimpleNamespace]:
        rows = self.tables[table.table_id]
        for start in range(start_index, len(rows), page_size):
            if start in self.fail_once_at:
                self.fail_once_at.discard(start)
                raise ConnectionError(f"503 tabledata.list from row {start}: backend unavailable")
            page = rows[start : start + page_size]
            self.pages.append((start, len(page)))
            yield from (SimpleNamespace(items=row.items) for row in page)


class Harness:
    """A store and a runner on one Redis and one in-memory bucket, stepped by the test (no background thread)."""

    def __init__(self, client: redis.Redis, **settings) -> None:
        self.client = client
        self.bucket = Bucket()
        self.store = BatchStore(client, self.bucket)
        self.serving = Serving()
        self.inference = Inference()
        self.log = Log()
        self.bigquery = BigQuery()
        self.settings = replace(Settings(), instance_id="api-test", **settings)
        self.runner = self.new_runner()

    def new_runner(self) -> BatchRunner:
        results = ResultStore(self.client, RESULT_TTL_SECONDS)
        return BatchRunner(
            self.settings, self.store, self.serving, self.inference, None, results, self.client, self.log,
            CATALOG, Storage(self.bucket), bigquery_client=self.bigquery,
        )  # type: ignore[arg-type]  # fmt: skip

    def submit(self, custom_ids: list[str | None], owner: str = "key-a", window_s: int = 3600) -> str:
        """A batch of `sleep` lines, one per custom_id (None: a line that is not JSON)."""
        batch_id = f"batch-{len(self.bucket.objects):020x}"
        text = "".join(("{not json\n" if custom_id is None else self.line(custom_id)) for custom_id in custom_ids)
        name = f"batches/{batch_id}/input.jsonl"
        self.bucket.objects[name] = text.encode()
        now_ms = int(time.time() * 1000)
        fields = {
            "owner": owner, "digest": "d", "status": "validating", "created_ms": now_ms,
            "expires_ms": now_ms + window_s * 1000, "input_file": f"gs://{BUCKET}/{name}", "completion_window": "1h",
            "metadata": "{}", "cursor_offset": 0, "cursor_line": 0,
        }  # fmt: skip
        assert self.store.create(batch_id, fields, max_active=100) is not None
        return batch_id

    def submit_table(self, custom_ids: list[str | None], owner: str = "key-a", window_s: int = 3600) -> str:
        """A batch naming a table of `sleep` rows, one per custom_id (None: a row whose `instances` text is not
        JSON, with custom_id `bad`)."""
        batch_id = f"batch-{len(self.bucket.objects) + len(self.bigquery.tables):020x}"
        table = f"inputs.lines.{batch_id.replace('-', '_')}"
        self.bigquery.tables[table] = [
            {"custom_id": custom_id, "model": "sleep", "instances": f'[{{"prompt": "{custom_id}"}}]'}
            if custom_id is not None
            else {"custom_id": "bad", "model": "sleep", "instances": "[{not json"}
            for custom_id in custom_ids
        ]
        now_ms = int(time.time() * 1000)
        fields = {
            "owner": owner, "digest": "d", "status": "validating", "created_ms": now_ms,
            "expires_ms": now_ms + window_s * 1000, "input_file": f"bq://{table}", "completion_window": "1h",
            "metadata": "{}", "cursor_offset": 0, "cursor_line": 0,
        }  # fmt: skip
        assert self.store.create(batch_id, fields, max_active=100) is not None
        return batch_id

    @staticmethod
    def line(custom_id: str) -> str:
        return f'{{"custom_id": "{custom_id}", "model": "sleep", "instances": [{{"prompt": "{custom_id}"}}]}}\n'

    def answer(self, batch_id: str, custom_id: str) -> None:
        """The worker's stored answer of a line (what the collector reads)."""
        request_id = line_request_id(batch_id, custom_id)
        reply = InferenceReply(request_id=request_id, model="sleep", model_version="1", status="ok", predictions=[])
        self.client.set(naming.result_key(request_id), reply.model_dump_json())

    def step_until(self, batch_id: str, done: Callable[[], bool], timeout: float = 30) -> None:
        """Steps the batch (under this runner's lease) until `done()`; fails past the deadline."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the condition was not reached"
            lease = self.store.acquire(batch_id, self.runner._token, self.settings.batch_lease_seconds)
            if lease != "renewed":
                self.runner._drop(batch_id)
            if lease is not None:
                self.runner.step(batch_id)

    def fields(self, batch_id: str) -> dict[str, str]:
        batch = self.store.get(batch_id, mirrored=False)
        return {} if batch is None else batch.fields

    def output(self, batch_id: str, kind: str) -> list[dict]:
        import json

        prefix = f"batches/{batch_id}/{kind}/"
        return [
            json.loads(text)
            for name, data in sorted(self.bucket.objects.items())
            if name.startswith(prefix)
            for text in data.decode().splitlines()
        ]

    def counts(self, batch_id: str) -> dict[str, int]:
        fields = self.fields(batch_id)
        return {name: int(fields.get(name) or 0) for name in ("total", "succeeded", "failed", "cancelled", "expired")}

"""Shadow traffic: a copy of a caller's request sent to the model's shadow version on threads of this process.

The caller never waits for it and never sees it: its answer is only logged, as a row with `endpoint = shadow`,
its own request id (`{primary}-shadow`) and `shadow_of` = the caller's request id, so SQL can compare both
versions' latency and errors on the same inputs. The billing view leaves shadow rows out. When the shadow
version falls behind and `MAX_IN_FLIGHT` copies are already waiting, further copies are dropped (counted
in the log as a warning), so a slow shadow can never hold the API's threads or memory.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.inference_log.writer import InferenceLogRow, InferenceLogWriter
from api_server.predict.dispatch import DispatchTimings
from api_server.predict.inference import InferenceService, PreparedRequest
from contract.generation import LOGGED_PARAMETERS
from contract.model_spec import ModelSpec
from contract.outcomes import Outcome

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 32
THREADS = 8
SHADOW_ENDPOINT = "shadow"


def shadow_request_id(request_id: str) -> str:
    return f"{request_id}-shadow"


class ShadowTraffic:
    def __init__(
        self, inference: InferenceService, inference_log: InferenceLogWriter, instance_id: str, reply_mode: str
    ) -> None:
        self._inference = inference
        self._log = inference_log
        self._instance_id = instance_id
        self._reply_mode = reply_mode
        self._slots = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="shadow")

    def send(self, prepared: PreparedRequest, spec: ModelSpec) -> bool:
        """Starts the shadow call and returns at once; False when too many are already in flight (dropped)."""
        if not self._slots.acquire(blocking=False):
            metrics.SHADOW_COPIES.labels(spec.name, "dropped").inc()
            log.warning("shadow copy of %s to %s v%s dropped: %d in flight", prepared.request_id, spec.name,
                        spec.version, MAX_IN_FLIGHT)  # fmt: skip
            return False
        # The shadow's row is its own, written here.
        shadow = prepared.for_version(spec, shadow_request_id(prepared.request_id), received=time.perf_counter())
        try:
            self._pool.submit(self._run, shadow, prepared.request_id)
        except RuntimeError:  # shutting down
            self._slots.release()
            return False
        metrics.SHADOW_COPIES.labels(spec.name, "sent").inc()
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, shadow: PreparedRequest, primary_id: str) -> None:
        spec = shadow.spec
        row = InferenceLogRow(
            request_id=shadow.request_id,
            created_at=datetime.now(UTC),
            model=spec.name,
            model_version=spec.version,
            task=spec.task,
            status="error",
            http_status=500,
            api_key_id=shadow.caller.key_id,
            api_instance=self._instance_id,
            cache_hit=False,
            endpoint=SHADOW_ENDPOINT,
            reply_mode=self._reply_mode,
            shadow_of=primary_id,
            num_images=len(shadow.prompts),
            priority=shadow.priority,
        )
        for name in LOGGED_PARAMETERS:
            setattr(row, name, getattr(shadow.params, name))
        try:
            reply = self._inference.run(shadow, DispatchTimings(), self._inference.job_deadline_ms())
            if reply is None:
                outcome, row.error = Outcome.TIMEOUT, f"no reply from the shadow within {spec.request_timeout_seconds}s"
            else:
                row.record_reply(reply)
                outcome = Outcome.for_reply(reply.status, reply.error_kind)
                row.error = reply.error
            row.status, row.http_status = outcome.spec.log_status, outcome.spec.http_status
            row.error_kind = row.error_kind or (None if outcome.answered else outcome.spec.error_kind)
        except ApiError as error:
            outcome = Outcome.for_http_status(error.status)
            row.status, row.http_status, row.error = outcome.spec.log_status, error.status, error.message
        except Exception as exc:  # noqa: BLE001 - a shadow failure is logged, never raised into the API
            log.exception("shadow call %s failed", shadow.request_id)
            row.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._slots.release()
        row.total_ms = round((time.perf_counter() - shadow.received) * 1000, 2)
        if row.error:
            row.error = row.error[:1024]
        self._log.write(row)

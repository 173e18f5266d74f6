"""Names of every Pub/Sub, GCS and BigQuery resource, derived in one place.

Terraform and the Kubernetes renderer follow the same convention; tests cross-check them against
these functions.
"""

from __future__ import annotations

PREFIX = "maas"
REPLIES_TOPIC = f"{PREFIX}-replies"
DATASET = "maas"
LOG_TABLE = "inference_log"
REPLY_SUBSCRIPTION_LABEL = {"maas-purpose": "reply-wait"}


def request_topic(model: str) -> str:
    return f"{PREFIX}-requests-{model}"


def worker_subscription(model: str) -> str:
    return f"{PREFIX}-requests-{model}-workers"


def dead_letter_topic(model: str) -> str:
    return f"{PREFIX}-requests-{model}-dead-letter"


def dead_letter_subscription(model: str) -> str:
    return f"{PREFIX}-requests-{model}-dead-letter-sub"


def reply_subscription(request_id: str) -> str:
    """Ephemeral per-request subscription on the replies topic."""
    return f"{PREFIX}-reply-{request_id}"


def instance_reply_subscription(instance_id: str) -> str:
    """Long-lived per-API-instance subscription on the replies topic."""
    return f"{PREFIX}-replies-instance-{instance_id}"


def model_bucket(project_id: str) -> str:
    return f"{project_id}-{PREFIX}-models"


def payload_bucket(project_id: str) -> str:
    return f"{project_id}-{PREFIX}-payloads"

"""Appends inference log rows through the BigQuery Storage Write API, on a committed stream with offsets.

Each API process owns one COMMITTED write stream. Every batch is appended at an explicit offset, and a
retry of the same batch uses the same offset: if the first try was committed after all, BigQuery answers
ALREADY_EXISTS and the batch counts as written. So a batch is written exactly once while its stream
lives. If the stream is gone (an emulator restart forgets streams) or an append is refused outright, whether
the batch was committed is unknown: before it goes to a new stream, the table is asked which of its request
ids it already holds (`written_request_ids`), and only the others are sent. So a row is stored once across a
stream loss too; the analytics views still count one row per request id, whatever reaches the table.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

from google.api_core import exceptions
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from contract.log_schema import log_schema_fields

log = logging.getLogger(__name__)
APPEND_TIMEOUT_SECONDS = 10
_ALREADY_EXISTS, _NOT_FOUND, _INVALID_ARGUMENT = 6, 5, 3
# Throttled or unavailable: nothing was committed, the same offset is retried after a backoff.
_TRY_SAME_OFFSET = {8, 14}  # RESOURCE_EXHAUSTED, UNAVAILABLE
_PROTO_TYPES = {
    "STRING": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "INTEGER": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "FLOAT": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
    "BOOLEAN": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "TIMESTAMP": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,  # microseconds since the epoch
}


class RowsRejectedError(Exception):
    """BigQuery refused rows of a batch (schema); retrying will not help."""


class StreamLostError(Exception):
    """The write stream is gone or cannot be trusted with this batch: it goes to a new stream."""


def row_descriptor() -> descriptor_pb2.DescriptorProto:
    """The log schema as a proto2 message: every field optional, so an absent value is NULL."""
    descriptor = descriptor_pb2.DescriptorProto(name="InferenceLogRow")
    for number, field in enumerate(log_schema_fields(), start=1):
        descriptor.field.add(
            name=field["name"],
            number=number,
            type=_PROTO_TYPES[field["type"]],
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    return descriptor


def _message_class(descriptor: descriptor_pb2.DescriptorProto):
    file_proto = descriptor_pb2.FileDescriptorProto(name="inference_log_row.proto", syntax="proto2")
    file_proto.message_type.add().CopyFrom(descriptor)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(descriptor.name))


class StorageWriteSink:
    def __init__(self, client, table_path: str, query_client=None) -> None:
        """`client`: a BigQueryWriteClient; `table_path`: projects/{p}/datasets/{d}/tables/{t}; `query_client`:
        a google.cloud.bigquery.Client, which answers `written_request_ids` (without one, none are known)."""
        from google.cloud.bigquery_storage_v1 import types

        self._types = types
        self._client = client
        self._table_path = table_path
        self._query_client = query_client
        self._descriptor = row_descriptor()
        self._row_class = _message_class(self._descriptor)
        self._timestamps = {f["name"] for f in log_schema_fields() if f["type"] == "TIMESTAMP"}
        self._lock = threading.Lock()
        self.stream: str | None = None
        self.next_offset = 0

    def open_stream(self) -> str:
        with self._lock:
            if self.stream is None:
                stream = self._client.create_write_stream(
                    parent=self._table_path,
                    write_stream=self._types.WriteStream(type_=self._types.WriteStream.Type.COMMITTED),
                    timeout=APPEND_TIMEOUT_SECONDS,
                )
                self.stream, self.next_offset = stream.name, 0
                log.info("inference log writes to stream %s", stream.name)
            return self.stream

    def forget_stream(self) -> None:
        with self._lock:
            self.stream = None

    def _serialize(self, row: dict) -> bytes:
        values = {}
        for name, value in row.items():
            if name in self._timestamps and isinstance(value, str):
                value = int(datetime.fromisoformat(value).timestamp() * 1_000_000)
            values[name] = value
        return self._row_class(**values).SerializeToString()

    def append(self, rows: list[dict], stream: str, offset: int) -> None:
        """Appends `rows` at `offset` of `stream`; a batch already committed there counts as written."""
        request = self._types.AppendRowsRequest(
            write_stream=stream,
            offset=offset,
            proto_rows=self._types.AppendRowsRequest.ProtoData(
                writer_schema=self._types.ProtoSchema(proto_descriptor=self._descriptor),
                rows=self._types.ProtoRows(serialized_rows=[self._serialize(row) for row in rows]),
            ),
        )
        try:
            responses = list(self._client.append_rows(iter([request]), timeout=APPEND_TIMEOUT_SECONDS))
        except exceptions.NotFound as exc:
            raise StreamLostError(str(exc)) from exc
        if not responses:
            # A server going down can close the stream without answering: that is not a commit.
            raise exceptions.ServiceUnavailable("the append got no response")
        for response in responses:
            if response.row_errors:
                raise RowsRejectedError("; ".join(f"row {e.index}: {e.message}" for e in response.row_errors))
            code = response.error.code if response.error else 0
            if code == _ALREADY_EXISTS:
                log.info("batch at offset %d of %s was already committed", offset, stream)
            elif code == _NOT_FOUND or code == _INVALID_ARGUMENT and "stream" in response.error.message.lower():
                raise StreamLostError(response.error.message)
            elif code in _TRY_SAME_OFFSET:
                raise exceptions.from_grpc_status(code, response.error.message)
            elif code:
                # Any other refusal: the emulator has been seen to consume the offset and then fail its insert
                # (its DuckDB connection busy), so a retry there would be told ALREADY_EXISTS and the rows lost.
                # A new stream cannot lose them.
                raise StreamLostError(f"append refused ({code}): {response.error.message}")
        with self._lock:
            if stream == self.stream:
                self.next_offset = max(self.next_offset, offset + len(rows))

    def written_request_ids(self, rows: list[dict]) -> set[str]:
        """Which of the rows' request ids the table holds already (asked before a lost stream's batch is resent).

        The rows' own `created_at` bounds the query to their partitions; it raises when BigQuery cannot answer,
        and the batch then waits, like any append that fails.
        """
        if self._query_client is None or not rows:
            return set()
        from google.cloud import bigquery

        _, project, _, dataset, _, table = self._table_path.split("/")
        created = [datetime.fromisoformat(row["created_at"]) for row in rows]
        config = bigquery.QueryJobConfig(
            query_parameters=[
                bigquery.ArrayQueryParameter("ids", "STRING", [row["request_id"] for row in rows]),
                bigquery.ScalarQueryParameter("earliest", "TIMESTAMP", min(created) - timedelta(minutes=1)),
                bigquery.ScalarQueryParameter("latest", "TIMESTAMP", max(created) + timedelta(minutes=1)),
            ]
        )
        sql = (
            f"SELECT DISTINCT request_id FROM `{project}.{dataset}.{table}` "
            "WHERE created_at BETWEEN @earliest AND @latest AND request_id IN UNNEST(@ids)"
        )
        job = self._query_client.query(sql, job_config=config, timeout=APPEND_TIMEOUT_SECONDS)
        return {row["request_id"] for row in job.result(timeout=APPEND_TIMEOUT_SECONDS)}


def write_client(settings):
    """The Storage Write API client: the emulator's gRPC port locally, Google's endpoint in production."""
    from google.cloud.bigquery_storage_v1 import BigQueryWriteClient
    from google.cloud.bigquery_storage_v1.services.big_query_write.transports import BigQueryWriteGrpcTransport

    if settings.bigquery_write_endpoint:
        import grpc

        channel = grpc.insecure_channel(settings.bigquery_write_endpoint)
        return BigQueryWriteClient(transport=BigQueryWriteGrpcTransport(channel=channel))
    return BigQueryWriteClient()

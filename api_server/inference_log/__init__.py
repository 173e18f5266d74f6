"""The inference log: one BigQuery row per request (and per stage, per job, per orphan), spooled to local
disk first, written through the Storage Write API, and read back as the caller's usage.

Imported one way: `records` and `job_rows` build rows, `writer` validates and queues them, `spool` keeps them on
disk and `bigquery_write` sends them."""

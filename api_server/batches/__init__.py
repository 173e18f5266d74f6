"""Batch jobs (issue 35): a JSONL file of requests run at `batch` priority on the capacity interactive traffic
leaves idle, answered line by line into results and errors files in GCS.

- `store.py`: the batch's record (Redis, mirrored to GCS) and the atomic steps the runner takes under its lease.
- `lines.py`: the input file read as a stream (never whole in memory) and each line validated as the predict
  route validates a body.
- `runner.py`: the feeder and collector in one background thread per API process; one process at a time works
  a batch (a Redis lease), and another resumes it from its last published line if that process dies.
- `service.py`: what the routes call (submit, read, list, cancel).
"""

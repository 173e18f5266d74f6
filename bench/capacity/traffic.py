"""A day of arrivals: a diurnal rate curve with bursts drawn as a Poisson process, or a recorded trace replayed.

Arrivals are two parallel arrays, times (seconds from midnight, sorted) and the index of each one's request
class in the mix. A request class is what the worker's batching rules look at: model, steps, size, strength and
images. The recorded trace is rows of the inference log (`maas.inference_log_unique`, `TRACE_SQL`; `export_trace` writes
one day of it), as CSV or JSON lines: `created_at` (ISO time or epoch seconds), `model`, `num_images`, `width`, `height`,
`num_inference_steps`; cache hits, coalesced requests and replays never reach a GPU and are left out by the query.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

DAY_SECONDS = 86_400
TRACE_COLUMNS = ("created_at", "model", "num_images", "width", "height", "num_inference_steps")
# Requests that reached a GPU on one day: no refusals, cache hits, coalesced requests, replays or shadow copies.
TRACE_SQL = """SELECT {columns}
FROM `{table}`
WHERE created_at >= @begin AND created_at < @end AND model_version IS NOT NULL AND status = 'ok'
  AND shadow_of IS NULL AND NOT cache_hit AND NOT coalesced AND NOT idempotent_replay
ORDER BY created_at"""


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in the mix; `share` is its part of the arrivals."""

    model: str
    steps: int
    width: int
    height: int
    strength: float | None = None
    images: int = 1
    share: float = 1.0

    @property
    def label(self) -> str:
        strength = f", strength {self.strength:g}" if self.strength is not None else ""
        images = f", {self.images} images" if self.images > 1 else ""
        return f"{self.model} {self.width}x{self.height}, {self.steps} steps{strength}{images}"


@dataclass(frozen=True)
class DayShape:
    """The rate over a day: `1 + amplitude x cos(2 pi (hour - peak_hour) / 24)`, times `burst_factor` during each of
    `bursts` bursts of `burst_minutes` at random times, scaled so that the day's expected total is `requests`; then,
    with `surge_hour`, a surge on top (issue 43's overload): `surge_minutes` from that hour at `surge_factor` times
    the busiest clock hour's mean rate, more requests than `requests`."""

    requests: int
    peak_hour: float = 15.0
    amplitude: float = 0.6
    bursts: int = 6
    burst_minutes: float = 10.0
    burst_factor: float = 2.0
    surge_hour: float | None = None
    surge_minutes: float = 20.0
    surge_factor: float = 2.0


@dataclass
class Arrivals:
    times: np.ndarray  # float64 seconds, sorted
    classes: np.ndarray  # int32 index into `mix`
    mix: list[RequestClass]
    start: float = 0.0  # arrivals before this are warm-up: simulated, not reported
    span: float = DAY_SECONDS  # seconds reported from `start` (a day, or a window of one)

    def __len__(self) -> int:
        return len(self.times)


def minute_rates(shape: DayShape, seed: int) -> np.ndarray:
    """Requests per second in each minute of the day (1,440 values)."""
    minutes = np.arange(24 * 60)
    hours = (minutes + 0.5) / 60
    curve = 1 + shape.amplitude * np.cos(2 * math.pi * (hours - shape.peak_hour) / 24)
    draw = np.random.default_rng(seed + 7919)
    for begin in draw.uniform(0, 24 * 60 - shape.burst_minutes, shape.bursts):
        curve[int(begin) : int(begin + shape.burst_minutes)] *= shape.burst_factor
    rates = curve * shape.requests / (curve.sum() * 60)
    if shape.surge_hour is not None:
        peak = rates.reshape(24, 60).mean(axis=1).max()
        begin = int(shape.surge_hour * 60)
        rates[begin : begin + int(shape.surge_minutes)] = shape.surge_factor * peak
    return rates


def day_arrivals(shape: DayShape, mix: list[RequestClass], seed: int, warmup_s: float = 3600.0) -> Arrivals:
    """Poisson arrivals minute by minute at `minute_rates`, classes drawn by share; `warmup_s` of the day's end
    comes first (negative times), so the day starts with the pods the night before left running."""
    rates = minute_rates(shape, seed)
    draw = np.random.default_rng(seed)
    warm_minutes = int(math.ceil(warmup_s / 60))
    minutes = np.arange(-warm_minutes, 24 * 60)
    counts = draw.poisson(rates[minutes % (24 * 60)] * 60)
    starts = np.repeat(minutes * 60.0, counts)
    times = np.sort(starts + draw.uniform(0, 60, counts.sum()))
    shares = np.array([c.share for c in mix], dtype=float)
    classes = draw.choice(len(mix), size=len(times), p=shares / shares.sum()).astype(np.int32)
    return Arrivals(times, classes, mix, start=0.0)


def window(arrivals: Arrivals, begin: float, end: float, warmup_s: float = 3600.0) -> Arrivals:
    """The arrivals of a day from `begin` to `end` (seconds), the `warmup_s` before `begin` simulated first and
    not reported: a few hours of the same day at its own rates, for a run shorter than the whole day's."""
    keep = (arrivals.times >= begin - warmup_s) & (arrivals.times < end)
    return Arrivals(arrivals.times[keep], arrivals.classes[keep], arrivals.mix, start=begin, span=end - begin)


def poisson_arrivals(rate: float, count: int, mix: list[RequestClass], seed: int) -> Arrivals:
    """`count` arrivals at a constant rate (a small day for tests and quick looks)."""
    draw = np.random.default_rng(seed)
    times = np.cumsum(draw.exponential(1 / rate, count))
    shares = np.array([c.share for c in mix], dtype=float)
    classes = draw.choice(len(mix), size=count, p=shares / shares.sum()).astype(np.int32)
    return Arrivals(times, classes, mix)


def trace_arrivals(path: Path, defaults: dict[str, float | None]) -> Arrivals:
    """A recorded trace (CSV or JSON lines), times from its first row's midnight (UTC); `defaults` maps a model to
    its catalog strength (the log has no strength column; img2img runs the catalog's unless a request said)."""
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    stamps = np.array([_seconds(row["created_at"]) for row in rows])
    midnight = math.floor(stamps.min() / DAY_SECONDS) * DAY_SECONDS
    index: dict[RequestClass, int] = {}
    classes = []
    for row in rows:
        key = RequestClass(row["model"], int(row["num_inference_steps"]), int(row["width"]), int(row["height"]),
                           defaults.get(row["model"]), int(row.get("num_images") or 1))  # fmt: skip
        classes.append(index.setdefault(key, len(index)))
    order = np.argsort(stamps, kind="stable")
    counts = np.bincount(classes, minlength=len(index))
    mix = [
        RequestClass(c.model, c.steps, c.width, c.height, c.strength, c.images, counts[i] / len(rows))
        for c, i in index.items()
    ]
    return Arrivals((stamps - midnight)[order], np.array(classes, dtype=np.int32)[order], mix)


def _read_rows(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _seconds(value) -> float:
    if isinstance(value, (int, float)) or str(value).replace(".", "", 1).isdigit():
        return float(value)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00").replace(" UTC", "+00:00")).timestamp()


def export_trace(client, table: str, day: str, path: Path) -> int:
    """One day (`YYYY-MM-DD`, UTC) of the inference log as a trace CSV, through a BigQuery client; rows written."""
    from datetime import UTC, timedelta

    from google.cloud import bigquery

    begin = datetime.fromisoformat(day).replace(tzinfo=UTC)
    parameters = [bigquery.ScalarQueryParameter("begin", "TIMESTAMP", begin),
                  bigquery.ScalarQueryParameter("end", "TIMESTAMP", begin + timedelta(days=1))]  # fmt: skip
    sql = TRACE_SQL.format(columns=", ".join(TRACE_COLUMNS), table=table)
    rows = client.query(sql, job_config=bigquery.QueryJobConfig(query_parameters=parameters)).result()
    count = 0
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(TRACE_COLUMNS)
        for row in rows:
            writer.writerow([row["created_at"].isoformat(), *(row[c] for c in TRACE_COLUMNS[1:])])
            count += 1
    return count

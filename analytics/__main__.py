"""Prints the analytics views (infra/sql) from the configured BigQuery, the emulator locally.

python -m analytics                              # every view, the last 7 days
python -m analytics billing_by_api_key_daily --since 2026-11-01 --model sd15-txt2img
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from google.cloud import bigquery

from contract import google_clients
from contract.settings import Settings, local_stack_environment

SQL_DIR = Path(__file__).resolve().parent.parent / "infra" / "sql"
# The column each view is bounded by in time; a view without one aggregates its whole history.
TIME_COLUMNS = {"day": "DATE", "hour": "TIMESTAMP", "at": "TIMESTAMP"}


def view_names() -> list[str]:
    return sorted(path.stem for path in SQL_DIR.glob("*.sql"))


def parse_since(value: str) -> datetime:
    """`7d`, `12h`, or an ISO date/time (UTC)."""
    if match := re.fullmatch(r"(\d+)([dh])", value):
        amount, unit = int(match[1]), match[2]
        return datetime.now(UTC) - (timedelta(days=amount) if unit == "d" else timedelta(hours=amount))
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def view_query(settings: Settings, view: str, columns: list[str], since: datetime | None, model: str | None):
    table = f"`{settings.project_id}.{settings.dataset}.{view}`"
    conditions, parameters = [], []
    time_column = next((column for column in TIME_COLUMNS if column in columns), None)
    if since is not None and time_column:
        value = since.date() if TIME_COLUMNS[time_column] == "DATE" else since
        conditions.append(f"{time_column} >= @since")
        parameters.append(bigquery.ScalarQueryParameter("since", TIME_COLUMNS[time_column], value))
    if model and "model" in columns:
        conditions.append("model = @model")
        parameters.append(bigquery.ScalarQueryParameter("model", "STRING", model))
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    order = ", ".join(column for column in columns[:2])
    return f"SELECT * FROM {table}{where} ORDER BY {order}", parameters


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    cells = [[_cell(row[column]) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(width) for column, width in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def report(
    client: bigquery.Client, settings: Settings, views: list[str], since: datetime | None, model: str | None
) -> str:
    sections = []
    for view in views:
        # A view's columns come from a query (a view's table metadata may carry no schema).
        probe = client.query(f"SELECT * FROM `{settings.project_id}.{settings.dataset}.{view}` LIMIT 0").result()
        sql, parameters = view_query(settings, view, [field.name for field in probe.schema], since, model)
        rows = [dict(row) for row in client.query(sql, job_config=bigquery.QueryJobConfig(query_parameters=parameters))]
        sections.append(f"== {view} ({len(rows)} rows)\n{format_table(rows)}")
    return "\n\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("views", nargs="*", help=f"views to print (default: all): {', '.join(view_names())}")
    parser.add_argument("--since", default="7d", help="7d, 12h or an ISO date (default 7d); 'all' for no bound")
    parser.add_argument("--model", help="only this model")
    parser.add_argument("--stack", type=Path, help="a local stack directory: query its BigQuery emulator")
    args = parser.parse_args(argv)
    if args.stack is not None:
        try:
            os.environ.update(local_stack_environment(args.stack))
        except FileNotFoundError as exc:
            parser.error(str(exc))
    unknown = sorted(set(args.views) - set(view_names()))
    if unknown:
        parser.error(f"unknown views {unknown}; choose from {view_names()}")
    settings = Settings.from_env()
    since = None if args.since == "all" else parse_since(args.since)
    print(report(google_clients.bigquery_client(settings), settings, args.views or view_names(), since, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

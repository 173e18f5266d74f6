"""`maas`: the command line over the SDK. Flags are checked before any request; errors are one line each.

Exit codes: 0 done, 1 the API refused or the job failed, 2 usage (a bad flag or file), 3 authentication,
4 rate limited, 5 server error or unreachable.
"""

from __future__ import annotations

import json
import re
import sys
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from maas_client import _core
from maas_client.client import Client, Job, ProgressCallback
from maas_client.errors import (
    ConnectionFailed,
    Forbidden,
    InputError,
    MaasError,
    RateLimited,
    ServerError,
    Timeout,
    Unauthorized,
)
from maas_client.types import BatchView, JobStatus, JobView, ModelDetail, ModelInfo, Result

EXIT_USAGE, EXIT_AUTH, EXIT_RATE_LIMITED, EXIT_SERVER = 2, 3, 4, 5
JOB_STATES = typing.get_args(JobStatus)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Model-as-a-Service from the command line.")
jobs_app = typer.Typer(no_args_is_help=True, help="Jobs: submit, status, wait (live progress), cancel, list.")
app.add_typer(jobs_app, name="jobs")
batches_app = typer.Typer(no_args_is_help=True, help="Batch jobs: create, get, list, cancel, wait (a progress bar).")
app.add_typer(batches_app, name="batches")
out = Console()
err = Console(stderr=True)
STATE: dict[str, Any] = {}


@app.callback()
def _options(
    url: Annotated[str | None, typer.Option(envvar="MAAS_URL", help="API base URL")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="MAAS_API_KEY", help="API key")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")] = False,
) -> None:
    STATE.update(url=url, api_key=api_key, json=as_json)


def _client() -> Client:
    try:
        return Client(STATE.get("url"), STATE.get("api_key"))
    except InputError as exc:
        _fail(exc)


def exit_code(error: MaasError) -> int:
    if isinstance(error, InputError):
        return EXIT_USAGE
    if isinstance(error, (Unauthorized, Forbidden)):
        return EXIT_AUTH
    if isinstance(error, RateLimited):
        return EXIT_RATE_LIMITED
    if isinstance(error, (ServerError, ConnectionFailed, Timeout)) and not error.request_id:
        return EXIT_SERVER
    if isinstance(error, ServerError):
        return EXIT_SERVER
    return 1


def _fail(error: MaasError) -> NoReturn:
    if STATE.get("json"):
        print(json.dumps({"error": {"code": error.status, "message": error.message, "field": error.field}}))
    else:
        where = f" [{error.field}]" if error.field else ""
        after = f" (retry after {error.retry_after:g}s)" if error.retry_after else ""
        err.print(f"error: {error.message}{where}{after}", markup=False, highlight=False)
    raise typer.Exit(exit_code(error))


def _emit(data: Any, human) -> None:
    if STATE.get("json"):
        print(json.dumps(data, default=str))
    else:
        human()


def print_table(
    headers: Sequence[str], rows: list[Sequence[str]], *, whole: int = 1, console: Console | None = None
) -> None:
    """A table whose first `whole` columns (the names a user copies: a model, a job id) are never cut.

    Not on a terminal (`maas models | cat`, a script): plain aligned rows, every column whole. On a terminal:
    a table, without its rightmost other columns while it is wider than the terminal; when even the whole
    columns do not fit, plain rows again (the terminal wraps them, the names stay whole)."""
    console = console or out
    if console.is_terminal:
        unbounded = console.options.update_width(1 << 16)  # a table's natural width, not the terminal's
        for width in range(len(headers), whole - 1, -1):
            grid = Table(*headers[:width])
            for column in grid.columns[:whole]:
                column.no_wrap = True
            for row in rows:
                grid.add_row(*row[:width])
            if console.measure(grid, options=unbounded).maximum <= console.width:
                console.print(grid)
                return
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    for row in (headers, *rows):
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)]
        console.file.write("  ".join(cells).rstrip() + "\n")


@contextmanager
def live_progress(label: str) -> Iterator[ProgressCallback]:
    """The progress bar on stderr that `jobs wait` and `predict` show (none with --json): `on_progress` in."""
    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("step"), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(), console=err, disable=bool(STATE.get("json")),
    )  # fmt: skip
    with bar:
        task = bar.add_task(label, total=None)

        def on_progress(step: int, total: int, stage: str | None = None) -> None:
            # A flow's progress names the stage running; its steps count all its stages'.
            bar.update(task, completed=step, total=total, description=f"{label} · {stage}" if stage else label)

        yield on_progress


def _check_options(
    size: str | None,
    steps: int | None,
    n: int,
    image: Path | None,
    out_dir: Path | None = None,
    mask: Path | None = None,
) -> None:
    """Every flag, before any request: a bad one is exit 2 with one line."""
    try:
        _core.parse_size(size)
        if steps is not None and steps < 1:
            raise InputError(f"--steps {steps}: at least 1")
        if not 1 <= n <= 16:
            raise InputError(f"--n {n}: between 1 and 16")
        if image is not None:
            _core.image_bytes(image)
        if mask is not None:  # without --image too: a flow that drafts, then repaints the draft under the mask
            try:
                _core.image_bytes(mask)
            except InputError as exc:
                raise InputError(f"--mask: {exc}") from None
        if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
            raise InputError(f"--out {out_dir}: not a directory")
    except InputError as exc:
        _fail(exc)


Size = Annotated[str | None, typer.Option(help="WIDTHxHEIGHT, e.g. 512x512")]
Seed = Annotated[int | None, typer.Option(help="seed of the first image (image i uses seed + i)")]
Steps = Annotated[int | None, typer.Option(help="denoising steps")]
ImageFile = Annotated[Path | None, typer.Option("--image", help="input image (PNG/JPEG) for image-to-image")]
MaskFile = Annotated[
    Path | None, typer.Option("--mask", help="inpaint models: a PNG the image's size, white repaints, black keeps")
]
Negative = Annotated[str | None, typer.Option("--negative", help="negative prompt")]
Count = Annotated[int, typer.Option("--n", help="number of images")]
OutDir = Annotated[Path, typer.Option("--out", help="directory for the PNGs")]


def _options_dict(seed, steps, size, image, negative, n, mask=None) -> dict:
    options = {"seed": seed, "steps": steps, "size": size, "image": image, "negative_prompt": negative, "n": n}
    return options if mask is None else {**options, "mask": mask}


@app.command()
def models() -> None:
    """The models the API serves, with their defaults, limits, inputs and the control models registered for them."""
    with _client() as client:
        try:
            # The listing says which control models a model takes; its own page, which are registered.
            listed = [client.model(m.name) if m.control_kinds else m for m in client.models()]
        except MaasError as exc:
            _fail(exc)

    _emit([m.model_dump() for m in listed], lambda: print_models(listed))


def print_models(listed: list[ModelInfo], console: Console | None = None) -> None:
    """One row per model with its family (`-` for a synthetic one); with several versions, the stable one is
    marked `*`; what an instance takes; the control models registered (or the kinds it takes, none registered yet).
    Names are never cut."""
    headers = ("model", "versions", "family", "task", "default size", "steps", "max size", "max images", "inputs",
               "controls")  # fmt: skip
    rows = [
        (
            m.name,
            _versions(m),
            _family(m),
            m.task,
            f"{m.defaults.width}x{m.defaults.height}",
            str(m.defaults.num_inference_steps),
            f"{m.limits.max_width}x{m.limits.max_height}",
            str(m.max_instances_per_request),
            ",".join(m.inputs or ["prompt"]),
            _controls(m),
        )
        for m in listed
    ]
    print_table(headers, rows, console=console)


def _controls(model: ModelInfo) -> str:
    """`tiny-edges (controlnet), tiny-style (ip_adapter)`; `none registered (controlnet, ip_adapter)`; `-`."""
    if isinstance(model, ModelDetail) and model.controls:
        return ", ".join(f"{control.name} ({control.kind})" for control in model.controls)
    return f"none registered ({', '.join(model.control_kinds)})" if model.control_kinds else "-"


def _family(model: ModelInfo) -> str:
    """A flow shows its stages' models in order, where a model shows its family."""
    if model.stages:
        return "flow:" + ">".join(stage.model for stage in model.stages)
    return model.family or "-"


def _versions(model: ModelInfo) -> str:
    if model.versions == [model.version]:
        return model.version
    return ",".join(f"{version}*" if version == model.version else version for version in model.versions)


def _print_result(result: Result, paths: list[Path]) -> None:
    data = {
        "request_id": result.request_id,
        "job_id": result.job_id,
        "files": [str(path) for path in paths],
        "seeds": result.seeds,
        "timings_ms": result.timings_ms,
        "cache": result.cache,
    }

    def human() -> None:
        for path in paths:
            print(path)
        out.print(f"request id {result.request_id}  seeds {', '.join(map(str, result.seeds))}", highlight=False)
        timings = "  ".join(f"{name} {value:.0f} ms" for name, value in result.timings_ms.items())
        out.print(f"timings: {timings}", highlight=False)

    _emit(data, human)


@app.command()
def predict(
    model: str,
    prompt: str,
    seed: Seed = None,
    steps: Steps = None,
    size: Size = None,
    image: ImageFile = None,
    mask: MaskFile = None,
    negative: Negative = None,
    n: Count = 1,
    out_dir: OutDir = Path("."),
    control: Annotated[
        list[str] | None,
        typer.Option(
            "--control",
            help="a ControlNet: NAME=IMAGE[:SCALE[:MODE]] (MODE: a ControlNet Union's; repeat it for several)",
        ),  # fmt: skip
    ] = None,
    canny: Annotated[bool, typer.Option("--canny", help="the worker makes Canny edges of each control image")] = False,
    image_prompt: Annotated[
        list[str] | None,
        typer.Option("--image-prompt", help="an image prompt (IP-Adapter): NAME=IMAGE[:SCALE] (repeat it for several)"),
    ] = None,
) -> None:
    """Generate images and write them as PNGs (a request that becomes a job is followed to its end)."""
    options = _options_dict(seed, steps, size, image, negative, n, mask)
    if control:
        try:
            controls = [_core.parse_control(text) for text in control]
            for index, parsed in enumerate(controls):
                _core.control_body(index, parsed)  # its image is read now: a bad one is refused before any request
        except InputError as exc:
            _fail(exc)
        options["controls"] = [{**c, "preprocess": "canny"} if canny else c for c in controls]
    if image_prompt:
        try:
            prompts = [_core.parse_control(text, "--image-prompt") for text in image_prompt]
            for index, parsed in enumerate(prompts):
                _core.control_body(index, parsed, "image_prompts")  # read now: a bad one is refused before a request
        except InputError as exc:
            _fail(exc)
        options["image_prompts"] = prompts
    _predict(model, prompt, options, out_dir)


@app.command()
def inpaint(
    image: Path,
    mask: Path,
    prompt: str,
    model: Annotated[str, typer.Option("--model", help="an inpaint model of `maas models`")] = "sd15-inpaint",
    seed: Seed = None,
    steps: Steps = None,
    size: Size = None,
    negative: Negative = None,
    n: Count = 1,
    out_dir: OutDir = Path("."),
) -> None:
    """Repaint the mask's white pixels of IMAGE (MASK: a PNG the image's size; white repaints, black keeps)."""
    _predict(model, prompt, _options_dict(seed, steps, size, image, negative, n, mask), out_dir)


@app.command()
def edit(
    image: Path,
    instruction: str,
    model: Annotated[str, typer.Option("--model", help="an edit model of `maas models`")] = "flux-kontext",
    seed: Seed = None,
    steps: Steps = None,
    size: Size = None,
    n: Count = 1,
    out_dir: OutDir = Path("."),
) -> None:
    """Edit IMAGE as INSTRUCTION says ("make it night"), keeping what it does not touch (FLUX.1 Kontext)."""
    _predict(model, instruction, _options_dict(seed, steps, size, image, None, n), out_dir)


def _predict(model: str, prompt: str, options: dict, out_dir: Path) -> None:
    _check_options(options["size"], options["steps"], options["n"], options["image"], out_dir, options.get("mask"))
    with _client() as client:
        try:
            with live_progress(model) as on_progress:
                result = client.predict(model, prompt, on_progress=on_progress, **options)
            paths = result.save(out_dir)
        except MaasError as exc:
            _fail(exc)
        except OSError as exc:
            _fail(InputError(f"--out {out_dir}: {exc.strerror or exc}"))
    _print_result(result, paths)


@jobs_app.command("submit")
def jobs_submit(
    model: str,
    prompt: str,
    seed: Seed = None,
    steps: Steps = None,
    size: Size = None,
    image: ImageFile = None,
    negative: Negative = None,
    n: Count = 1,
) -> None:
    """Queue a job and print its id."""
    _check_options(size, steps, n, image)
    with _client() as client:
        try:
            job = client.submit(model, prompt, **_options_dict(seed, steps, size, image, negative, n))
        except MaasError as exc:
            _fail(exc)
    _emit({"id": job.id}, lambda: print(job.id))


def _view_line(view: JobView) -> str:
    progress = f" step {view.progress.step}/{view.progress.total}" if view.progress else ""
    error = f": {view.error.message}" if view.error else ""
    return f"{view.id} {view.status}{progress}{error}"


@jobs_app.command("status")
def jobs_status(job_id: str) -> None:
    """A job's status, progress, result or error."""
    with _client() as client:
        try:
            view = client.job(job_id).status()
        except MaasError as exc:
            _fail(exc)
    data = view.model_dump(by_alias=True, exclude={"result"})
    _emit(data, lambda: out.print(_view_line(view), highlight=False, markup=False))


@jobs_app.command("wait")
def jobs_wait(job_id: str, out_dir: OutDir = Path(".")) -> None:
    """Follow a job with a live progress bar; Ctrl-C asks whether to cancel it."""
    _check_options(None, None, 1, None, out_dir)
    with _client() as client:
        job = client.job(job_id)
        try:
            with live_progress(f"job {job_id[:12]}") as on_progress:
                result = job.wait(on_progress=on_progress)
            paths = result.save(out_dir)
        except KeyboardInterrupt:
            _ask_to_cancel(job)
        except MaasError as exc:
            _fail(exc)
    _print_result(result, paths)


def _ask_to_cancel(job: Job) -> NoReturn:
    try:
        cancel = typer.confirm(f"\nCancel job {job.id}?", default=False, err=True)
    except (KeyboardInterrupt, typer.Abort, EOFError):
        cancel = False
    if cancel:
        try:
            view = job.cancel()
        except MaasError as exc:
            _fail(exc)
        err.print(f"job {job.id} {view.status}", highlight=False)
    else:
        err.print(f"left running: maas jobs wait {job.id}", highlight=False)
    raise typer.Exit(130)


@jobs_app.command("cancel")
def jobs_cancel(job_id: str) -> None:
    """Cancel a job (a queued one never runs, a running one stops at its next step)."""
    with _client() as client:
        try:
            view = client.job(job_id).cancel()
        except MaasError as exc:
            _fail(exc)
    _emit(view.model_dump(by_alias=True, exclude={"result"}), lambda: print(_view_line(view)))


@jobs_app.command("list")
def jobs_list(
    limit: Annotated[int, typer.Option(help="the newest N, 1 to 1000")] = 20,
    state: Annotated[str | None, typer.Option(help=f"only jobs in this state: {', '.join(JOB_STATES)}")] = None,
) -> None:
    """Your jobs (the API key's, from any machine), newest first, with their status now."""
    if not 1 <= limit <= 1000:
        _fail(InputError(f"--limit {limit}: from 1 to 1000"))
    if state is not None and state not in JOB_STATES:
        _fail(InputError(f"--state {state!r}: one of {', '.join(JOB_STATES)}"))
    with _client() as client:
        try:
            views = list(client.list_jobs(state=state, limit=limit))  # type: ignore[arg-type]
        except MaasError as exc:
            _fail(exc)
    rows = [{"id": v.id, "model": v.model, "status": v.status, "created_at": v.created_at} for v in views]

    def table() -> None:
        cells = [(row["id"], row["model"], row["status"], row["created_at"]) for row in rows]
        print_table(("job", "model", "status", "created"), cells)

    _emit(rows, table)


@app.command()
def usage(since: Annotated[str, typer.Option(help="7d, 30d or a date YYYY-MM-DD")] = "7d") -> None:
    """Your own usage and GPU-seconds per day and model (the API's billing view)."""
    if not re.fullmatch(r"\d{1,4}d|\d{4}-\d{2}-\d{2}", since):
        _fail(InputError(f"--since {since!r}: expected Nd (e.g. 7d) or YYYY-MM-DD"))
    with _client() as client:
        try:
            report = client.usage(since)
        except MaasError as exc:
            _fail(exc)

    def table() -> None:
        cells = [
            (row.day, row.model, str(row.requests), str(row.succeeded), str(row.images), str(row.cache_hits),
             f"{row.gpu_seconds:.2f}")
            for row in report.days
        ]  # fmt: skip
        t = report.totals
        cells.append(("total", "", str(t.requests), str(t.succeeded), str(t.images), str(t.cache_hits),
                      f"{t.gpu_seconds:.2f}"))  # fmt: skip
        out.print(f"key {report.api_key_id} since {report.since}", highlight=False)
        print_table(("day", "model", "requests", "succeeded", "images", "cache hits", "GPU s"), cells, whole=2)

    _emit(report.model_dump(), table)


def _batch_line(view: BatchView) -> str:
    counts = view.request_counts
    error = f": {view.error.message}" if view.error else ""
    return (f"{view.id} {view.status}: {counts.succeeded} succeeded, {counts.failed} failed, {counts.cancelled} "
            f"cancelled, {counts.expired} expired of {counts.total} read{error}")  # fmt: skip


def _emit_batch(view: BatchView) -> None:
    _emit(view.model_dump(), lambda: out.print(_batch_line(view), highlight=False, markup=False))


def _batch_call(call: Callable[[Client], BatchView]) -> None:
    """One batch call (create, get, cancel): its view printed, or its error with the CLI's exit code."""
    with _client() as client:
        try:
            view = call(client)
        except MaasError as exc:
            _fail(exc)
    _emit_batch(view)


@batches_app.command("create")
def batches_create(
    source: Annotated[
        str,
        typer.Argument(help="gs://bucket/file.jsonl, bq://project.dataset.table, or a local .jsonl file sent inline"),
    ],
    window: Annotated[str, typer.Option("--window", help="completion window: 24h, 30m, 90s")] = "24h",
    webhook: Annotated[str | None, typer.Option(help="https URL called once when the batch ends")] = None,
    metadata: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
) -> None:
    """Submit a batch: one JSON line per request, {"custom_id", "model", "instances", "parameters"}."""
    pairs = [item.partition("=") for item in metadata or []]
    if any(not key or not sep for key, sep, _ in pairs):
        _fail(InputError("--metadata: KEY=VALUE"))
    options: dict[str, Any] = {"completion_window": window, "webhook_url": webhook,
                               "metadata": {key: value for key, _, value in pairs}}  # fmt: skip
    if source.startswith("gs://"):
        options["input_file"] = source
    elif source.startswith("bq://"):
        options["input_table"] = source
    else:
        path = Path(source)
        if not path.is_file():
            _fail(InputError(f"{source}: neither gs://..., bq://... nor a file here"))
        try:
            options["requests"] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except ValueError as exc:
            _fail(InputError(f"{source}: not JSON lines ({exc})"))
    _batch_call(lambda client: client.batches.create(**options))


@batches_app.command("get")
def batches_get(batch_id: str) -> None:
    """A batch's status, request counts and output locations."""
    _batch_call(lambda client: client.batches.get(batch_id))


@batches_app.command("list")
def batches_list(limit: Annotated[int, typer.Option(help="the newest N, 1 to 1000")] = 20) -> None:
    """Your batches, newest first."""
    if not 1 <= limit <= 1000:
        _fail(InputError(f"--limit {limit}: from 1 to 1000"))
    with _client() as client:
        try:
            views = list(client.batches.list(limit=limit))
        except MaasError as exc:
            _fail(exc)

    def table() -> None:
        cells = [
            (v.id, v.status, f"{v.request_counts.done}/{v.request_counts.total}", str(v.request_counts.succeeded),
             str(v.request_counts.failed), v.created_at)
            for v in views
        ]  # fmt: skip
        print_table(("batch", "status", "done", "succeeded", "failed", "created"), cells)

    _emit([view.model_dump() for view in views], table)


@batches_app.command("cancel")
def batches_cancel(batch_id: str) -> None:
    """Cancel a batch: nothing more runs, what finished stays in its results."""
    _batch_call(lambda client: client.batches.cancel(batch_id))


@batches_app.command("wait")
def batches_wait(batch_id: str) -> None:
    """Follow a batch to its end with a progress bar (lines done of lines read); exit 1 unless it completed."""
    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("lines"),
        TimeElapsedColumn(), console=err, disable=bool(STATE.get("json")),
    )  # fmt: skip
    with _client() as client, bar:
        task = bar.add_task(f"batch {batch_id[:18]}", total=None)

        def show(view: BatchView) -> None:
            counts = view.request_counts
            bar.update(task, completed=counts.done, total=counts.total or None, description=view.status)

        try:
            view = client.batches.wait(batch_id, on_progress=show)
        except MaasError as exc:
            _fail(exc)
    _emit_batch(view)
    if view.status != "completed":
        raise typer.Exit(1)


def main() -> None:
    try:
        app(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

"""The `maas` command line's tables: a model name or job id is never cut, on a terminal of any width or piped."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from maas_client.cli import print_models
from maas_client.types import ModelInfo

NAMES = ("sd15-txt2img", "sd15-img2img", "a-model-with-a-rather-long-name-v2", "noop")


def model(name: str, versions: list[str], stable: str = "1") -> ModelInfo:
    return ModelInfo.model_validate({
        "name": name, "version": stable, "versions": versions, "task": "text-to-image",
        "family": None if name == "noop" else "sdxl" if "long" in name else "sd15",
        "guidance": "cfg", "size_multiple": 8,
        "max_instances_per_request": 4, "request_timeout_seconds": 120,
        "defaults": {"num_inference_steps": 25, "guidance_scale": 7.5, "width": 512, "height": 512},
        "limits": {"max_inference_steps": 50, "max_width": 1024, "max_height": 1024},
    })  # fmt: skip


LISTED = [model(name, ["1"]) for name in NAMES[:-1]] + [model("noop", ["1", "2"])]


def rendered(width: int, terminal: bool) -> str:
    buffer = io.StringIO()
    print_models(LISTED, Console(file=buffer, width=width, force_terminal=terminal, color_system=None))
    return buffer.getvalue()


def test_piped_output_is_plain_rows_with_every_name_whole_whatever_the_width():
    text = rendered(40, terminal=False)
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["model", "versions"]
    assert [line.split()[0] for line in lines[1:]] == list(NAMES)
    assert [line.split()[1] for line in lines[1:]] == ["1", "1", "1", "1*,2"]  # the stable version marked
    assert lines[0].split()[2] == "family"
    assert [line.split()[2] for line in lines[1:]] == ["sd15", "sd15", "sdxl", "-"]  # `-`: a synthetic model
    assert "…" not in text and "│" not in text


@pytest.mark.parametrize("width", [30, 50, 70, 99, 160])
def test_a_terminal_of_any_width_shows_whole_names_dropping_other_columns_first(width):
    text = rendered(width, terminal=True)
    assert "…" not in text
    for name in NAMES:
        assert name in text, (width, text)
    if width >= 160:
        assert "max images" in text and "sdxl" in text  # room for every column
    if width >= len(NAMES[2]) + 4:  # the names fit in a table: it fits the terminal
        assert "│" in text and all(len(line) <= width for line in text.splitlines()), text
    else:  # they do not: plain rows, which the terminal wraps
        assert [line.split()[0] for line in text.splitlines()[1:]] == list(NAMES), text


def test_maas_models_shows_inputs_and_the_control_models_registered_for_each_model(monkeypatch):
    """The listing says which control models a model takes; `maas models` asks those models' own pages which are
    registered (only those: one request more per such model) and shows them beside what an instance takes."""
    from contextlib import contextmanager

    from typer.testing import CliRunner

    from maas_client import cli
    from maas_client.types import ControlInfo, ModelDetail

    takes = model("sd15-txt2img", ["1"]).model_copy(update={"control_kinds": ["controlnet", "ip_adapter"]})
    bare = model("sd15-inpaint", ["1"]).model_copy(update={"control_kinds": ["controlnet"], "task": "inpaint",
                                                           "inputs": ["prompt", "image", "mask"]})  # fmt: skip
    asked: list[str] = []

    class Client:
        def models(self):
            return [takes, bare, model("noop", ["1"])]

        def model(self, name: str):
            asked.append(name)
            registered = [{"name": "tiny-edges", "kind": "controlnet", "version": "1"},
                          {"name": "tiny-style", "kind": "ip_adapter", "version": "1"}]  # fmt: skip
            listed = {"sd15-txt2img": takes, "sd15-inpaint": bare}[name]
            return ModelDetail(**listed.model_dump(), stable_version="1",
                               controls=[ControlInfo.model_validate(c) for c in registered] if name == takes.name
                               else [])  # fmt: skip

    @contextmanager
    def client():
        yield Client()

    monkeypatch.setattr(cli, "_client", client)
    done = CliRunner().invoke(cli.app, ["models"], env={"COLUMNS": "300"})
    assert done.exit_code == 0, done.output
    assert asked == ["sd15-txt2img", "sd15-inpaint"]  # noop takes none: not asked
    # Piped: aligned cells, two spaces or more apart; the last two are the inputs and the controls.
    rows = {line.split()[0]: [cell.strip() for cell in line.split("  ") if cell.strip()][-2:]
            for line in done.output.splitlines()[1:]}  # fmt: skip
    assert rows["sd15-txt2img"] == ["prompt", "tiny-edges (controlnet), tiny-style (ip_adapter)"]
    assert rows["sd15-inpaint"] == ["prompt,image,mask", "none registered (controlnet)"]
    assert rows["noop"] == ["prompt", "-"]

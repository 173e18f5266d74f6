"""The SDK's and the CLI's ControlNets: `controls` in the request body as the API takes them (the image as base64),
`--control NAME=IMAGE[:SCALE[:MODE]]` parsed and checked before any request is sent."""

from __future__ import annotations

import base64

import pytest
from PIL import Image
from typer.testing import CliRunner

from maas_client import _core, cli
from maas_client.errors import InputError


def test_controls_go_in_the_body_with_their_images_as_base64(tmp_path):
    edges = tmp_path / "edges.png"
    Image.new("RGB", (32, 32)).save(edges, format="PNG")
    body = _core.predict_body("a lighthouse", controls=[{"name": "tiny-edges", "image": edges, "scale": 0.8,
                                                         "end": 0.75, "preprocess": "canny"}])  # fmt: skip
    assert body["parameters"]["controls"] == [{"name": "tiny-edges", "image": base64.b64encode(edges.read_bytes()).decode(),
                                               "scale": 0.8, "end": 0.75, "preprocess": "canny"}]  # fmt: skip
    with pytest.raises(InputError, match=r"^controls\[0\].image: "):
        _core.predict_body("x", controls=[{"name": "tiny-edges", "image": b"not a png"}])
    with pytest.raises(InputError, match=r"^controls\[0\]: a dict with name and image"):
        _core.predict_body("x", controls=[{"name": "tiny-edges"}])


def test_the_control_flag_reads_name_image_and_an_optional_scale():
    assert _core.parse_control("tiny-edges=edges.png:0.8") == {"name": "tiny-edges", "image": "edges.png", "scale": 0.8}
    assert _core.parse_control("tiny-edges=edges.png") == {"name": "tiny-edges", "image": "edges.png"}
    assert _core.parse_control("depth=C:/maps/depth.png") == {"name": "depth", "image": "C:/maps/depth.png"}
    for bad in ("tiny-edges", "=edges.png", "tiny-edges="):
        with pytest.raises(InputError, match="NAME=IMAGE"):
            _core.parse_control(bad)


def test_the_cli_refuses_a_bad_control_before_any_request(tmp_path, monkeypatch):
    monkeypatch.setenv("MAAS_URL", "http://127.0.0.1:9")  # nothing listens: a request would fail otherwise
    result = CliRunner().invoke(cli.app, ["predict", "sd15-txt2img", "x", "--control", "tiny-edges"])
    assert result.exit_code == 2 and "NAME=IMAGE" in result.output
    missing = CliRunner().invoke(cli.app, ["predict", "sd15-txt2img", "x", "--control", "e=nothing-here.png:0.5"])
    assert missing.exit_code == 2 and "controls[0].image" in missing.output


def test_image_prompts_go_in_the_body_and_the_image_prompt_flag_is_checked_before_any_request(tmp_path, monkeypatch):
    reference = tmp_path / "reference.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(reference, format="PNG")
    body = _core.predict_body("a lighthouse", image_prompts=[{"name": "tiny-style", "image": reference, "scale": 0.6}])
    assert body["parameters"]["image_prompts"] == [{"name": "tiny-style", "scale": 0.6,
                                                    "image": base64.b64encode(reference.read_bytes()).decode()}]  # fmt: skip
    with pytest.raises(InputError, match=r"^image_prompts\[0\].image: "):
        _core.predict_body("x", image_prompts=[{"name": "tiny-style", "image": b"not a png"}])
    assert _core.parse_control("tiny-style=ref.png:0.6", "--image-prompt") == {"name": "tiny-style", "image": "ref.png",
                                                                              "scale": 0.6}  # fmt: skip
    monkeypatch.setenv("MAAS_URL", "http://127.0.0.1:9")  # nothing listens: a request would fail otherwise
    result = CliRunner().invoke(cli.app, ["predict", "sd15-txt2img", "x", "--image-prompt", "tiny-style"])
    assert result.exit_code == 2 and "--image-prompt" in result.output and "NAME=IMAGE" in result.output
    missing = CliRunner().invoke(cli.app, ["predict", "sd15-txt2img", "x", "--image-prompt", "s=nothing.png:0.5"])
    assert missing.exit_code == 2 and "image_prompts[0].image" in missing.output


def test_a_union_mode_goes_in_the_body_from_the_sdk_and_from_the_control_flags_third_part(tmp_path, monkeypatch):
    from maas_client import Control

    edges = tmp_path / "edges.png"
    Image.new("RGB", (32, 32)).save(edges, format="PNG")
    union: Control = {"name": "union", "image": edges, "scale": 0.9, "mode": 3}
    body = _core.predict_body("a lighthouse", controls=[union])
    assert body["parameters"]["controls"] == [{"name": "union", "image": base64.b64encode(edges.read_bytes()).decode(),
                                               "scale": 0.9, "mode": 3}]  # fmt: skip
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(InputError, match=r"^controls\[0\]\.mode .*an integer from 0"):
            _core.predict_body("x", controls=[{**union, "mode": bad}])
    with pytest.raises(InputError, match=r"^image_prompts\[0\]\.mode 3: an image prompt has none"):
        _core.predict_body("x", image_prompts=[{"name": "style", "image": edges, "mode": 3}])
    parse = _core.parse_control
    assert parse("union=edges.png:0.8:3") == {"name": "union", "image": "edges.png", "scale": 0.8, "mode": 3}
    assert parse("union=edges.png::3") == {"name": "union", "image": "edges.png", "mode": 3}  # the default scale
    assert parse("union=C:/maps/edges.png:1:2") == {"name": "union", "image": "C:/maps/edges.png", "scale": 1.0,
                                                    "mode": 2}  # fmt: skip
    assert parse("edges=edges.png:2") == {"name": "edges", "image": "edges.png", "scale": 2.0}  # one number: a scale
    sent: dict = {}
    monkeypatch.setattr(cli, "_predict", lambda model, prompt, options, out_dir: sent.update(options))
    result = CliRunner().invoke(cli.app, ["predict", "sd15-txt2img", "x", "--control", f"union={edges}:0.8:7"])
    assert result.exit_code == 0, result.output
    assert sent["controls"] == [{"name": "union", "image": str(edges), "scale": 0.8, "mode": 7}]

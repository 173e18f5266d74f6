"""The SDK's and the CLI's ControlNets: `controls` in the request body as the API takes them (the image as base64),
`--control NAME=IMAGE[:SCALE]` parsed and checked before any request is sent."""

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

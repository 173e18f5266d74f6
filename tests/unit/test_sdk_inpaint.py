"""The SDK's and the CLI's inpainting: a mask (and outpainting) in the request body, and the flags checked before
any request is sent."""

from __future__ import annotations

import base64

import pytest
from PIL import Image
from typer.testing import CliRunner

from maas_client import _core, cli
from maas_client.errors import InputError


def png_file(tmp_path, name: str, mode: str = "RGB", size=(64, 64)):
    path = tmp_path / name
    Image.new(mode, size).save(path, format="PNG")
    return path


def test_a_mask_and_outpainting_go_in_the_body_as_the_api_takes_them(tmp_path):
    image, mask = png_file(tmp_path, "image.png"), png_file(tmp_path, "mask.png", "L")
    body = _core.predict_body("a window", image=image, mask=mask, n=2)
    assert [instance["mask"] for instance in body["instances"]] == [base64.b64encode(mask.read_bytes()).decode()] * 2
    outpainted = _core.predict_body("more sky", image=image, outpaint={"top": 64})
    assert outpainted["parameters"] == {"outpaint": {"top": 64}} and "mask" not in outpainted["instances"][0]
    with pytest.raises(InputError, match="^mask: "):
        _core.predict_body("x", image=image, mask=b"not a png")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["predict", "sd15-inpaint", "x", "--mask", "{text}"], "--mask: "),
        (["inpaint", "{image}", "{text}", "x"], "--mask: "),
    ],
)
def test_the_cli_refuses_a_mask_that_is_no_image_before_any_request(tmp_path, args, words):
    files = {"image": png_file(tmp_path, "image.png"), "mask": png_file(tmp_path, "mask.png", "L"),
             "text": tmp_path / "notes.txt"}  # fmt: skip
    files["text"].write_text("not an image")
    argv = [arg.format(**files) for arg in args]
    # An unreachable server: a flag refused first never gets as far as connecting.
    done = CliRunner().invoke(cli.app, argv, env={"MAAS_URL": "http://127.0.0.1:9", "MAAS_API_KEY": "k"})
    assert done.exit_code == 2, done.output
    assert words in done.output


def test_maas_predict_sends_a_mask_without_an_image_to_a_flow_that_drafts_then_repaints(tmp_path, monkeypatch):
    sent = {}
    monkeypatch.setattr(cli, "_predict", lambda model, prompt, options, out_dir: sent.update(
        model=model, body=_core.predict_body(prompt, **options)))  # fmt: skip
    mask = png_file(tmp_path, "mask.png", "L")
    done = CliRunner().invoke(cli.app, ["predict", "sd15-draft-repaint", "a door", "--mask", str(mask)])
    assert done.exit_code == 0, done.output
    assert sent["model"] == "sd15-draft-repaint"
    assert sent["body"]["instances"] == [{"prompt": "a door", "mask": base64.b64encode(mask.read_bytes()).decode()}]


def test_maas_inpaint_takes_image_mask_and_prompt_in_that_order():
    done = CliRunner().invoke(cli.app, ["inpaint", "--help"], env={"COLUMNS": "200"})
    assert done.exit_code == 0
    usage = next(line for line in done.output.splitlines() if "Usage" in line)
    assert usage.index("{image}") < usage.index("{mask}") < usage.index("{prompt}")


def test_models_listing_reads_a_models_inputs():
    from maas_client.types import ModelInfo

    info = ModelInfo.model_validate({
        "name": "sd15-inpaint", "version": "1", "versions": ["1"], "task": "inpaint",
        "inputs": ["prompt", "image", "mask"], "family": "sd15", "guidance": "cfg", "size_multiple": 8,
        "max_instances_per_request": 4, "request_timeout_seconds": 90,
        "defaults": {"num_inference_steps": 8, "guidance_scale": 7.5, "width": 256, "height": 256, "strength": 1.0},
        "limits": {"max_inference_steps": 50, "max_width": 1024, "max_height": 1024},
    })  # fmt: skip
    assert info.task == "inpaint" and info.inputs == ["prompt", "image", "mask"]


def test_maas_edit_takes_the_image_then_the_instruction_and_sends_them_to_the_edit_model(tmp_path, monkeypatch):
    done = CliRunner().invoke(cli.app, ["edit", "--help"], env={"COLUMNS": "200"})
    assert done.exit_code == 0 and "flux-kontext" in done.output
    usage = next(line for line in done.output.splitlines() if "Usage" in line)
    assert usage.index("{image}") < usage.index("{instruction}")
    sent = {}

    def predict(model, prompt, options, out_dir):
        sent.update(model=model, prompt=prompt, body=_core.predict_body(prompt, **options))

    monkeypatch.setattr(cli, "_predict", predict)
    image = png_file(tmp_path, "photo.png")
    done = CliRunner().invoke(cli.app, ["edit", str(image), "make it night", "--steps", "4"])
    assert done.exit_code == 0, done.output
    assert (sent["model"], sent["prompt"]) == ("flux-kontext", "make it night")
    assert sent["body"]["instances"] == [
        {"prompt": "make it night", "image": base64.b64encode(image.read_bytes()).decode()}
    ]
    assert sent["body"]["parameters"] == {"num_inference_steps": 4}

"""The GPU check (`make gpu-check`): its tiny mode on a CPU prints the table and writes its JSON without the
service clients a GPU image lacks; a line that fails or has no time left is a MISS and the others still run; the
host-read counter counts what a denoising step must not do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]
# The lines the tiny run here covers: all but the compiled ones (compiling, even with torch.compile's eager backend,
# takes minutes of a shared 2-core machine; `make gpu-check TINY=1` runs them).
TINY_LINES = [
    "sd15.",
    "batch",
    "open-loop",
    "flux.build",
    "flux.bf16",
    "flux.step-cache",
    "flux.taylorseer",
    "flux.controlnet",
    "sd35.step-cache",
    "zimage.bf16",
    "flux2-klein.bf16",
    "qwenimage.bf16",
    "qwenimage.release",
    "flux-fill.bf16",
    "flux-kontext.bf16",
]
# What a GPU image lacks: the service clients (and what only they pull in), the API's web stack, plotting.
ABSENT = ("google.cloud", "google.api_core", "google.auth", "grpc", "redis", "flask", "prometheus_client", "matplotlib")
BLOCKED = f"import sys; [sys.modules.__setitem__(m, None) for m in {ABSENT!r}]"


def test_the_tiny_check_prints_its_table_and_writes_its_json_without_the_service_clients(tmp_path):
    code = f"{BLOCKED}; from bench.gpu_check import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "--tiny", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work"),
            "--budget", "600", "--lines", *TINY_LINES]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "stand-ins for absent clients: google.cloud.pubsub_v1" in done.stdout
    assert "| result | line | measured | target |" in done.stdout
    document = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    lines = {line["key"]: line for line in document["lines"]}
    expected = {"sd15.direct", "sd15.worker-request", "sd15.worker-step", "sd15.lone-2", "sd15.lone-4", "sd15.syncs",
                "sd15.lone-4-phases", "sd15.scheduler-steps", "batch.interactive", "open-loop.sweep", "flux.build", "flux.bf16",
                "sd15.step-cache", "flux.step-cache", "flux.taylorseer", "sd35.step-cache", "sd15.controlnet",
                "flux.controlnet",
                "zimage.build", "zimage.bf16", "flux2-klein.build", "flux2-klein.bf16", "qwenimage.build",
                "qwenimage.bf16", "qwenimage.release", "flux-fill.build", "flux-fill.bf16", "flux-kontext.build",
                "flux-kontext.bf16"}  # fmt: skip
    assert expected <= set(lines), sorted(set(lines))
    # Each 2026 family's image at its tiny size, against its own memory plan (the weights' figure is the family's);
    # FLUX.1 Fill's and Kontext's with an input image (and mask), against theirs (issue 51).
    for family, plan_gb in (("zimage", 20.5), ("flux2-klein", 16.0), ("qwenimage", 57.7), ("flux-fill", 33.7),
                            ("flux-kontext", 33.7)):  # fmt: skip
        line = lines[f"{family}.bf16"]
        assert line["measured"].endswith("s/image (memory: GPU only)") and f"loaded <= {plan_gb} GB" in line["target"]
    assert not (tmp_path / "work" / "qwenimage-tiny").exists(), "the release line left Qwen-Image's weights"
    phases = lines["sd15.lone-4-phases"]["detail"]
    assert phases["step"]["calls"] == 5 and phases["step"]["start"] > 0 and phases["step"]["decode"] > 0
    assert phases["request"]["generate"] >= phases["request"]["to_first_step"] > 0
    steps = lines["sd15.scheduler-steps"]["detail"]
    assert len(steps) == 7 and all(row["set_ops"] < row["per_image_ops"] for n, row in steps.items() if "Flow" not in n)
    # Each step cache line: half the steps after the warm-up skipped (forced), both timings in one run; its kind's.
    for key, kind in (("sd15.step-cache", "deepcache"), ("flux.step-cache", "first_block"),
                      ("flux.taylorseer", "taylorseer"), ("sd35.step-cache", "first_block")):  # fmt: skip
        row = lines[key]["detail"]
        assert (row["steps"], row["steps_skipped_per_image"]) == (4, 2), row  # steps 1 and 3 (step 0 warms up)
        assert row["ms_per_step_with"] > 0 and row["ms_per_step_without"] > 0
        assert f"eager, {kind} " in lines[key]["name"], lines[key]["name"]
    assert not (tmp_path / "work" / "sd35-tiny").exists(), "the SD 3.5 step cache line left its weights"
    errors = {key: line["measured"] for key, line in lines.items() if line["measured"].startswith(("error", "skipped"))}
    assert errors == {}
    assert all(line["result"] in ("PASS", "MISS", "INFO") for line in lines.values())
    assert (tmp_path / "out" / "gpu-check.md").read_text().count("\n| ") == len(lines) + 1


def test_a_failing_or_late_line_is_a_miss_and_the_next_still_runs(tmp_path, monkeypatch):
    ran = []

    def fails(check):
        raise RuntimeError("the card fell over")

    def works(check):
        ran.append("works")
        check.add("b", "works", gpu_check.PASS, "1", "1")

    lines = [gpu_check.LineSpec("a", fails, 0.0), gpu_check.LineSpec("late", works, 1e9),
             gpu_check.LineSpec("b", works, 0.0)]  # fmt: skip
    monkeypatch.setattr(gpu_check, "LINES", lines)
    check = gpu_check.Check(tiny=True, budget=60, workdir=tmp_path, out=tmp_path / "out", selected=None)
    check.cuda = True  # the budget is judged as on a GPU: "late" needs more than is left
    gpu_check.run_lines(check)
    results = [(line.key, line.result, line.measured.split(":")[0]) for line in check.lines]
    assert results == [("a", "MISS", "error"), ("late", "MISS", "skipped"), ("b", "PASS", "1")]
    assert ran == ["works"]


def test_host_reads_are_counted_while_active_and_the_tensor_methods_restored():
    torch = pytest.importorskip("torch")
    tensor = torch.ones(3)
    before = {name: torch.Tensor.__dict__.get(name) for name in gpu_check.HOST_READS}
    with gpu_check.HostReads(cuda=False) as counted:
        tensor.sum().item()
        bool(tensor[0] > 0)
        tensor * 2  # stays a tensor: not a read
    assert counted.reads == {"item": 1, "__bool__": 1}
    assert {name: torch.Tensor.__dict__.get(name) for name in gpu_check.HOST_READS} == before
    tensor.sum().item()
    assert counted.reads == {"item": 1, "__bool__": 1}


@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
def test_on_cuda_a_sync_is_counted_with_the_line_that_made_it():
    import torch

    tensor = torch.ones(3, device="cuda")
    with gpu_check.HostReads(cuda=True) as counted:
        tensor.sum().item()
    assert counted.syncs >= 1
    assert any(site.startswith("test_gpu_check.py:") for site in counted.sync_sites), counted.sync_sites


def test_a_compile_mode_is_taken_from_the_catalog_or_reported_not_available(tmp_path):
    from pydantic import BaseModel

    from contract.catalog import load_catalog

    class Compile(BaseModel):
        mode: str = "default"

    class WithObject(BaseModel):
        compile: Compile | None = Compile()

    class WithMode(BaseModel):
        compile_mode: str = "reduce-overhead"

    class Without(BaseModel):
        name: str = "m"

    assert gpu_check.catalog_compile_mode(WithObject()) == "default"
    assert gpu_check.catalog_compile_mode(WithMode()) == "reduce-overhead"
    assert gpu_check.catalog_compile_mode(Without()) is None
    check = gpu_check.Check(tiny=True, budget=60, workdir=tmp_path, out=tmp_path / "out", selected=None)
    check.tiny = False  # judged as on a GPU: a model that names no mode is compiled in the catalog's default
    spec = load_catalog().get("sd15-txt2img")
    mode, refusal = gpu_check.compile_mode_or_refusal(check, spec)
    assert refusal is None
    assert mode == (gpu_check.catalog_compile_mode(spec) or "default (the catalog's default)")


def test_the_compiled_line_gets_what_the_budget_leaves_after_the_selected_lines_after_it(tmp_path):
    def check(budget: float, selected: list[str] | None, cap: float | None = None):
        return gpu_check.Check(tiny=True, budget=budget, workdir=tmp_path, out=tmp_path / "out", selected=selected,
                               compile_cap=cap)  # fmt: skip

    # The compiled lines alone: all of the budget but the warm start's share (its own cap) and a margin.
    alone = gpu_check.compile_cap(check(400, ["sd15-compiled"]))
    assert 400 - gpu_check.WARM_START_SECONDS - 20 <= alone <= 400 - gpu_check.WARM_START_SECONDS - 10
    # The whole check: the FLUX lines after it keep their time, the compiled line its least share.
    assert gpu_check.compile_cap(check(420, None)) == gpu_check.COMPILE_CAP
    assert gpu_check.compile_cap(check(420, ["sd15-compiled"], cap=250)) == 250


def test_lines_select_by_name_and_dotted_parts_not_by_any_prefix(tmp_path):
    def keys(*names: str) -> set[str]:
        check = gpu_check.Check(tiny=True, budget=60, workdir=tmp_path, out=tmp_path / "out", selected=list(names))
        return {spec.key for spec in gpu_check.LINES if gpu_check.selected(check, spec) and spec.key != "release-sd15"}

    assert keys("flux.bf16") == {"flux.bf16"}
    assert keys("sd15") == keys("sd15.") == {"sd15.direct", "sd15.worker-request", "sd15.worker-step", "sd15.lone",
                                             "sd15.syncs", "sd15.scheduler-steps", "sd15.step-cache",
                                             "sd15.controlnet"}  # fmt: skip
    assert keys("sd15-compiled") == {"sd15-compiled", "sd15-compiled.warm-start"}
    assert keys("sd15-compiled.warm-start") == {"sd15-compiled", "sd15-compiled.warm-start"}  # the line it needs
    assert {"flux.build", "flux.bf16", "flux.bf16-compiled"} <= keys("flux")
    assert keys("qwenimage") == {"qwenimage.build", "qwenimage.bf16", "qwenimage.float8_weight_only",
                                 "qwenimage.release"}  # fmt: skip
    assert keys("zimage.bf16") == {"zimage.bf16"}  # it builds its weights itself when run alone


def test_a_familys_build_that_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    """Qwen-Image's real-size weights (57.7 GB) beside FLUX.1's 34 GB would fill a lent machine's 64 GiB part-way: the
    build says so first, and its line is a MISS with the reason."""
    import shutil
    from types import SimpleNamespace

    check = gpu_check.Check(tiny=True, budget=60, workdir=tmp_path, out=tmp_path / "out", selected=None)
    check.tiny = False  # judged as on a GPU: the real size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=30e9))
    with pytest.raises(
        RuntimeError, match="its weights need 59 GB of disk and 30 GB are free .* .--lines qwenimage. alone"
    ):
        gpu_check.child_family_build(check, {"family": "qwenimage"})
    assert list(tmp_path.iterdir()) == [], "it wrote something"


def test_flux_fills_and_kontexts_real_size_build_links_flux1s_encoders_and_writes_only_its_transformer(tmp_path,
                                                                                                       monkeypatch):  # fmt: skip
    """The GPU line's build (bench/quantized_pipeline.py `build_flux_tool_sized`) with a tiny transformer over the
    tiny FLUX.1: FLUX.1's text encoders, tokenizers and VAE linked, not copied; its own transformer and [dev]'s
    scheduler written; diffusers loads the pipeline it makes (the TINY run above answers through one)."""
    from bench import quantized_pipeline

    flux = quantized_pipeline.weights_for("flux", True, tmp_path)
    tiny = {"patch_size": 1, "in_channels": 16 + 16 + 4 * 64, "out_channels": 16, "num_layers": 1,
            "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
            "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8], "guidance_embeds": True}  # fmt: skip
    monkeypatch.setitem(quantized_pipeline.FLUX_TOOLS, "flux-fill", tiny)
    fill = quantized_pipeline.build_flux_tool_sized("flux-fill", tmp_path / "flux-fill-sized", flux)
    assert all((fill / name).is_symlink() for name in ("text_encoder", "text_encoder_2", "tokenizer", "vae"))
    assert not (fill / "transformer").is_symlink() and json.loads((fill / "model_index.json").read_text())[
        "_class_name"] == "FluxFillPipeline"  # fmt: skip
    assert json.loads((fill / "scheduler" / "scheduler_config.json").read_text())["use_dynamic_shifting"]
    from diffusers import FluxFillPipeline

    pipeline = FluxFillPipeline.from_pretrained(fill)
    assert (
        pipeline.transformer.config.in_channels == tiny["in_channels"] and pipeline.transformer.config.guidance_embeds
    )


def test_sd35s_step_cache_line_refuses_a_build_the_disk_cannot_hold_before_writing(tmp_path, monkeypatch):
    """SD 3.5 Large's weights without T5 (17.9 GB) beside FLUX.1's 34 GB: the line's child says so before building."""
    import shutil
    from types import SimpleNamespace

    check = gpu_check.Check(tiny=True, budget=60, workdir=tmp_path, out=tmp_path / "out", selected=None)
    check.tiny = False  # judged as on a GPU: the real size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=10e9))
    with pytest.raises(RuntimeError, match="its weights need 19 GB of disk and 10 GB are free .* .--lines sd35. alone"):
        gpu_check.child_sd35_step_cache(check, {})
    assert list(tmp_path.iterdir()) == [], "it wrote something"


def test_sd35s_real_size_build_writes_both_clips_and_leaves_t5_out(tmp_path, monkeypatch):
    """The GPU line's build (bench/quantized_pipeline.py `build_recorded_sized`) with the tiny SD 3.5's configurations
    standing in for the recorded ones: the transformer, both CLIPs and the VAE built from them, T5 and its tokenizer
    left out, and diffusers loads what it writes (the TINY run above answers through the tiny pipeline)."""
    import shutil

    from diffusers import StableDiffusion3Pipeline

    from bench import quantized_pipeline
    from emulators import tiny_pipeline

    tiny = quantized_pipeline.weights_for("sd35", True, tmp_path)
    for name in quantized_pipeline.RECORDED_COMPONENTS["sd35"]:
        (tmp_path / "configs" / "sd3.5-large" / name).mkdir(parents=True)
        shutil.copy(tiny / name / "config.json", tmp_path / "configs" / "sd3.5-large" / name / "config.json")
    monkeypatch.setattr(quantized_pipeline, "CONFIGS", tmp_path / "configs")
    # Its tokenizers' pipeline: a copy of the one built above (a second build would cost a second).
    monkeypatch.setattr(tiny_pipeline, "build_pipeline", lambda out, *args: shutil.copytree(tiny, out, symlinks=True))
    built = quantized_pipeline.build_recorded_sized("sd35", tmp_path / "sd35-sized")
    index = json.loads((built / "model_index.json").read_text())
    assert index["text_encoder_3"] == index["tokenizer_3"] == [None, None]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    pipeline = StableDiffusion3Pipeline.from_pretrained(built, text_encoder_3=None, tokenizer_3=None)  # as `without:`
    assert pipeline.text_encoder_3 is None and pipeline.transformer.config.num_layers == 1

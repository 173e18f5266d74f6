"""The container images: what they install, copy and run, checked without a Docker engine."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "infra" / "docker"
API_DOCKERFILE = DOCKER_DIR / "api.Dockerfile"
WORKER_DOCKERFILE = DOCKER_DIR / "worker.Dockerfile"
REGISTRY = "${_REGION}-docker.pkg.dev/$PROJECT_ID/maas"


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction with its continuation lines joined."""

    keyword: str
    arguments: str


def parse_dockerfile(path: Path) -> list[Instruction]:
    text = re.sub(r"\\\n", " ", path.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, arguments = line.partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip()))
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last_from = max(i for i, instruction in enumerate(instructions) if instruction.keyword == "FROM")
    return instructions[last_from:]


def command(instructions: list[Instruction]) -> list[str]:
    """The exec-form command the container runs (ENTRYPOINT followed by CMD)."""
    argv: list[str] = []
    for keyword in ("ENTRYPOINT", "CMD"):
        found = [i for i in final_stage(instructions) if i.keyword == keyword]
        if found:
            argv += json.loads(found[-1].arguments)  # exec form only: a shell would swallow SIGTERM
    return argv


def copied_sources(instructions: list[Instruction]) -> set[str]:
    """Repository paths copied from the build context into the final stage."""
    sources: set[str] = set()
    for instruction in final_stage(instructions):
        if instruction.keyword == "COPY" and "--from=" not in instruction.arguments:
            *paths, _destination = shlex.split(instruction.arguments)
            sources.update(path.rstrip("/") for path in paths)
    return sources


def env_value(instructions: list[Instruction], name: str) -> str:
    for instruction in final_stage(instructions):
        if instruction.keyword == "ENV":
            for pair in shlex.split(instruction.arguments):
                key, _, value = pair.partition("=")
                if key == name:
                    return value
    raise AssertionError(f"{name} is not set in the final stage")


API = parse_dockerfile(API_DOCKERFILE)
WORKER = parse_dockerfile(WORKER_DOCKERFILE)
IMAGES = {"api": API, "worker": WORKER}


def test_api_image_runs_gunicorn_with_the_projects_config_and_app() -> None:
    assert command(API) == [
        "gunicorn",
        "--config",
        "api_server/process/gunicorn_conf.py",
        "api_server.process.asgi:app",
    ]
    assert (REPO_ROOT / "api_server" / "process" / "gunicorn_conf.py").is_file()
    assert (REPO_ROOT / "api_server" / "process" / "asgi.py").is_file()


def test_worker_image_runs_the_model_worker_module() -> None:
    assert command(WORKER) == ["python", "-m", "model_worker"]
    assert (REPO_ROOT / "model_worker" / "__main__.py").is_file()


def test_each_image_copies_the_contract_and_only_its_own_service() -> None:
    assert copied_sources(API) == {"contract", "api_server"}
    assert copied_sources(WORKER) == {"contract", "model_worker"}


def test_api_image_installs_requirements_txt_only_and_no_torch() -> None:
    instructions = " ".join(instruction.arguments for instruction in API)
    assert "-r /tmp/requirements.txt" in instructions
    assert "requirements-worker" not in instructions and "torch" not in instructions
    requirement_names = [
        re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower()
        for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert not {"torch", "diffusers", "transformers"} & set(requirement_names)
    assert not any(name.startswith("-r") for name in requirement_names)


def test_worker_image_installs_the_worker_requirements_on_a_cuda_runtime() -> None:
    assert "-r /tmp/requirements-worker.txt" in WORKER_DOCKERFILE.read_text()
    assert (REPO_ROOT / "requirements-worker.txt").is_file()
    (cuda_arg,) = [i for i in WORKER if i.keyword == "ARG" and i.arguments.startswith("CUDA_IMAGE=")]
    assert re.fullmatch(r"CUDA_IMAGE=nvidia/cuda:12\.\d+\.\d+-cudnn-runtime-ubuntu22\.04", cuda_arg.arguments)
    assert command(WORKER)[0] == "python" and "python3.11 -m venv" in WORKER_DOCKERFILE.read_text()


@pytest.mark.parametrize("image", IMAGES)
def test_images_build_a_venv_in_a_builder_stage_and_copy_it_into_the_runtime(image: str) -> None:
    instructions = IMAGES[image]
    stages = [i.arguments for i in instructions if i.keyword == "FROM"]
    assert len(stages) == 2 and stages[0].endswith(" AS builder")
    assert Instruction("COPY", "--from=builder /opt/venv /opt/venv") in final_stage(instructions)
    assert env_value(instructions, "PATH").startswith("/opt/venv/bin:")


@pytest.mark.parametrize("image", IMAGES)
def test_images_run_as_a_non_root_user(image: str) -> None:
    users = [i.arguments for i in final_stage(IMAGES[image]) if i.keyword == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}


@pytest.mark.parametrize(("image", "path"), [("api", "/healthz"), ("worker", "/livez")])
def test_images_declare_a_healthcheck_on_the_liveness_endpoint(image: str, path: str) -> None:
    (healthcheck,) = [i.arguments for i in final_stage(IMAGES[image]) if i.keyword == "HEALTHCHECK"]
    assert path in healthcheck


def test_api_image_listens_on_port_8080_by_default() -> None:
    assert env_value(API, "PORT") == "8080"
    assert Instruction("EXPOSE", "8080") in final_stage(API)


def test_worker_image_health_port_matches_the_kubernetes_probes() -> None:
    rendered = (REPO_ROOT / "infra" / "k8s" / "render.py").read_text()
    port = env_value(WORKER, "MAAS_WORKER_HEALTH_PORT")
    assert port == "8081"
    assert f"WORKER_HEALTH_PORT = {port}" in rendered
    assert Instruction("EXPOSE", port) in final_stage(WORKER)


def test_cloud_build_builds_both_images_and_pushes_them_to_artifact_registry() -> None:
    build = yaml.safe_load((REPO_ROOT / "infra" / "cloudbuild.yaml").read_text())
    assert build["images"] == [f"{REGISTRY}/api:$SHORT_SHA", f"{REGISTRY}/worker:$SHORT_SHA"]
    built = {}
    for step in build["steps"]:
        args = step["args"]
        assert args[0] == "build" and args[-1] == "."  # the repository root is the build context
        dockerfile = next(a.removeprefix("--file=") for a in args if a.startswith("--file="))
        tag = next(a.removeprefix("--tag=") for a in args if a.startswith("--tag="))
        built[tag] = dockerfile
        assert (REPO_ROOT / dockerfile).is_file()
    assert built == {
        f"{REGISTRY}/api:$SHORT_SHA": "infra/docker/api.Dockerfile",
        f"{REGISTRY}/worker:$SHORT_SHA": "infra/docker/worker.Dockerfile",
    }
    assert "_REGION" in build["substitutions"]


def test_dockerignore_keeps_local_state_and_tests_out_of_the_build_context() -> None:
    ignored = set((REPO_ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv*", "tests", ".stack", "**/__pycache__"} <= ignored

"""The layering as import-linter contracts (`[tool.importlinter]` in pyproject.toml): kept by the code, and
able to fail: each contract is broken once in a throwaway project that carries the same configuration."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
# One import per contract that breaks it and no other: (module, the line it gains).
BREAKS = {
    "api-not-worker": ("api_server/predict/serving.py", "import model_worker.held.pool"),
    "worker-not-api": ("model_worker/held/pool.py", "import api_server.predict.serving"),
    "contract-not-services": ("contract/outcomes.py", "import api_server.predict.serving"),
    "services-not-emulators": ("model_worker/held/pool.py", "import emulators.stack"),
    "routes-not-clients": ("api_server/process/routes/predict.py", "import redis"),
    "weights-one-way": ("model_worker/weights/store.py", "import model_worker.weights.importer"),
}
# The layers of the weights room, each a stand-in module in the throwaway project (a layers contract needs them).
WEIGHTS_LAYERS = [f"model_worker/weights/{name}.py" for name in ("__main__", "cli", "importer", "checkpoints", "store")]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_project_keeps_every_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


def test_every_contract_has_a_break_below():
    assert {contract["id"] for contract in CONTRACTS} == set(BREAKS)


@pytest.fixture
def layered_project() -> Iterator[Path]:
    """A project laid out like this one (the modules the breaks touch, empty) with the same contracts.

    In a directory of its own, not pytest's `tmp_path`: pytest sessions running beside this one prune the
    shared base directory's older entries."""
    with tempfile.TemporaryDirectory(prefix="layering-") as directory:
        yield _lay_out(Path(directory))


def _lay_out(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    stand_ins = {path for path, _ in BREAKS.values()} | {"emulators/stack.py", "contract/google_clients.py"}
    for module in stand_ins | set(WEIGHTS_LAYERS):
        for parent in reversed(Path(module).parents):
            if parent != Path("."):
                (tmp_path / parent).mkdir(exist_ok=True)
                (tmp_path / parent / "__init__.py").touch()
        (tmp_path / module).write_text('"""A stand-in."""\n')
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "__init__.py").touch()
    (tmp_path / "google").mkdir()
    (tmp_path / "google" / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("contract_id", sorted(BREAKS))
def test_a_broken_contract_fails_the_check(layered_project: Path, contract_id: str):
    assert lint_imports(layered_project).returncode == 0
    module, line = BREAKS[contract_id]
    with (layered_project / module).open("a") as source:
        source.write(line + "\n")
    result = lint_imports(layered_project)
    [contract] = [contract for contract in CONTRACTS if contract["id"] == contract_id]
    assert result.returncode == 1
    assert f"{contract['name']} BROKEN" in result.stdout
    assert f"Contracts: {len(CONTRACTS) - 1} kept, 1 broken." in result.stdout

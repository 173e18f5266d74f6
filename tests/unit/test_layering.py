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
    "api-rooms": ("api_server/core/errors.py", "import api_server.predict.serving"),
    "worker-rooms": ("model_worker/model/runners.py", "import model_worker.serving.finisher"),
    "no-circles": ("contract/flows.py", "import contract.catalog"),
}
# Every room the rooms' contracts name, and every package checked for circles, as a stand-in package.
ROOMS = [
    *(f"api_server/{room}/__init__.py" for room in ("process", "batches", "predict", "jobs", "versions", "flows",
                                                   "inference_log", "core")),
    *(f"model_worker/{room}/__init__.py" for room in ("serving", "flows", "held", "model", "weights", "adapters")),
    "model_worker/__main__.py", "bench/__init__.py", "maas_client/__init__.py", "emulators/__init__.py",
]  # fmt: skip
# Stand-ins with imports of their own: the one the circle's break closes (the catalog builds flows), and the
# memory plan's command line, which loads the catalog (the circle contract's one ignored import).
STAND_IN_IMPORTS = {
    "contract/catalog.py": "import contract.flows\n",
    "contract/memory_plan.py": "import contract.catalog\n",
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
    for module in stand_ins | set(WEIGHTS_LAYERS) | set(ROOMS) | set(STAND_IN_IMPORTS):
        for parent in reversed(Path(module).parents):
            if parent != Path("."):
                (tmp_path / parent).mkdir(exist_ok=True)
                (tmp_path / parent / "__init__.py").touch()
        (tmp_path / module).write_text('"""A stand-in."""\n' + STAND_IN_IMPORTS.get(module, ""))
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


def import_circle(imports: dict[str, set[str]]) -> list[str] | None:
    """One circle in a module graph (module -> modules it imports), or None."""
    done: set[str] = set()
    for start in sorted(imports):
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(start, iter(sorted(imports.get(start, ()))))]
        if start in done:
            continue
        path.append(start)
        on_path.add(start)
        while stack:
            module, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(module)
                done.add(module)
            elif child in on_path:
                return path[path.index(child) :] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(imports.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return None


def test_the_circle_finder_finds_a_circle_and_none_in_a_chain():
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_api_has_no_import_circle_between_any_two_modules():
    """Its request rooms use each other (api-rooms), but module by module the API's imports still run one way."""
    import grimp

    graph = grimp.build_graph("api_server", cache_dir=None)
    imports = {
        module: {imported for imported in graph.find_modules_directly_imported_by(module) if imported in graph.modules}
        for module in graph.modules
    }
    assert import_circle(imports) is None

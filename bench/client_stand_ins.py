"""Import-time stand-ins for the service clients the worker's serving modules import at module level.

The GPU check runs the worker's pool, device loop and finisher with every service in memory
(bench/worker_harness.py), but `model_worker.serving` and `contract.payloads` / `contract.stores` import
google.cloud, google.api_core, redis and prometheus_client when loaded. A GPU node's image has none of them, so
where one cannot be imported this puts an inert module in its place: its names are classes that accept any call
(exceptions where the name says Error or names a Google API error), never used to reach a service. Nothing is
replaced where the real package imports.
"""

from __future__ import annotations

import importlib
import sys
import types

# What the serving modules import, by module: the stand-in is made only where the import fails.
MODULES = (
    "google.cloud.pubsub_v1",
    "google.cloud.storage",
    "google.api_core.exceptions",
    "google.auth.credentials",
    "redis",
    "prometheus_client",
    "prometheus_client.core",
)


class Inert:
    """Accepts any construction, attribute or call and does nothing (a metric, a client type)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> Inert:
        return self

    def __getattr__(self, name: str) -> Inert:
        return self


class StandInModule(types.ModuleType):
    """A module whose every missing name is made on first use: an exception class or an inert class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        error = name.endswith(("Error", "Exception")) or self.__name__.endswith("exceptions")
        made = type(name, (Exception,) if error else (Inert,), {"__module__": self.__name__})
        if name == "generate_latest":
            made = lambda *args, **kwargs: b""  # noqa: E731 - prometheus_client's exposition, empty
        setattr(self, name, made)
        return made


def install_if_missing() -> list[str]:
    """Puts a stand-in where a client module cannot be imported; returns the modules stood in for."""
    stood_in = []
    for name in MODULES:
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            dotted = ".".join(parts[:depth])
            module = sys.modules.get(dotted)
            if module is None or (depth == len(parts) and not isinstance(module, StandInModule)):
                try:
                    module = importlib.import_module(dotted) if depth < len(parts) else None
                except ImportError:
                    module = None
                if module is None:
                    module = StandInModule(dotted)
                    module.__path__ = []  # a package: its submodules can be stood in for too
                    sys.modules[dotted] = module
            if depth > 1:
                setattr(sys.modules[".".join(parts[: depth - 1])], parts[depth - 1], module)
        stood_in.append(name)
    return stood_in

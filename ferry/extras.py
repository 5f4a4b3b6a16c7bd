"""Optional features and the pip extra that installs each one's packages.

``pip install ferry`` runs the engine (``LLM``, ``ferry generate``, ``chat``, ``demo``,
``simulate``); the server, the plots and data-parallel replicas need an extra.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# Top-level module -> the extra that installs it.
EXTRA_OF_MODULE = {
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "prometheus_client": "server",
    "httpx": "server",
    "jsonschema": "server",
    "matplotlib": "bench",
    "ray": "ray",
}
# Installed apart, without their dependencies (xgrammar's include triton, GPU-only): module -> pip arguments.
WITHOUT_DEPS = {"xgrammar": "--no-deps xgrammar==0.2.9"}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that installs it."""


def extra_for(error: ImportError) -> str | None:
    """The extra that installs the module ``error`` failed to import, or None if no extra does."""
    return EXTRA_OF_MODULE.get((error.name or "").split(".")[0])


def install_hint(module: str, extra: str | None, feature: str | None = None) -> str:
    """One sentence: what is missing and the pip command that installs it."""
    what = f"{feature} needs" if feature else "ferry needs"
    command = f"pip install 'ferry[{extra}]'" if extra else f"pip install {WITHOUT_DEPS[module]}"
    return f"{what} the package '{module}', which is not installed: {command}"


def missing_extra(error: ImportError, feature: str | None = None) -> MissingExtraError | None:
    """``error`` restated with the pip command that installs the missing package, or None when it is
    not an optional package's."""
    module = (error.name or "").split(".")[0]
    extra = extra_for(error)
    if extra is None and module not in WITHOUT_DEPS:
        return None
    return MissingExtraError(install_hint(module, extra, feature), name=error.name)


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (an optional package), or raise MissingExtraError naming its extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        err = missing_extra(e, feature)
        if err is None:
            raise
        raise err from e

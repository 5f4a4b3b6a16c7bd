"""The packages depend one way: core <- model <- executor <- engine <- sim, server, cli.

Read from the source (ast, nothing imported): every import statement counts, those inside
functions and under ``TYPE_CHECKING`` too. And the executor's contract is one base class that
every executor subclasses, used by the engine without probing.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FERRY = ROOT / "ferry"

# What each package may not import (a name, or anything under it). ``ferry`` alone is the package's
# ``__init__``, which pulls in the engine's outputs.
FORBIDDEN = {
    "ferry.executor": ("ferry", "ferry.engine", "ferry.sim", "ferry.server", "ferry.cli", "ferry.bench", "ferry.llm"),
    "ferry.engine": ("ferry", "ferry.server", "ferry.sim", "ferry.cli", "ferry.bench", "ferry.llm"),
    "ferry.model": ("ferry", "ferry.engine", "ferry.executor", "ferry.server", "ferry.sim", "ferry.cli",
                    "ferry.bench", "ferry.llm"),
}
# The core imports nothing of ferry but itself and the settings.
CORE_ALLOWED = ("ferry.core", "ferry.config")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ferry_imports(path: Path) -> set[str]:
    """Every ferry module ``path`` imports, relative imports resolved; ``from ferry.x import y``
    counts as ``ferry.x.y`` when y is a module, else ``ferry.x``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (ROOT / Path(*sub.split("."))).is_dir()
                found.add(sub if is_module else base)
    return {m for m in found if m == "ferry" or m.startswith("ferry.")}


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def modules(package: str) -> list[Path]:
    return sorted((ROOT / Path(*package.split("."))).rglob("*.py"))


def test_the_reader_sees_imports_of_every_kind():
    """Not vacuous: top-level, function-local, relative and TYPE_CHECKING imports are all found."""
    assert "ferry.core.scheduler" in ferry_imports(FERRY / "engine" / "llm_engine.py")
    assert "ferry.executor.tensor_parallel" in ferry_imports(FERRY / "engine" / "llm_engine.py")  # in a function
    assert "ferry.model.config" in ferry_imports(FERRY / "executor" / "base.py")  # under TYPE_CHECKING
    assert "ferry.engine.llm_engine" in ferry_imports(FERRY / "server" / "replicas.py")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_a_layer_above_it(package):
    wrong = [f"{module_name(p)} imports {m}" for p in modules(package) for m in sorted(ferry_imports(p))
             if any(under(m, f) if f != "ferry" else m == "ferry" for f in FORBIDDEN[package])]
    assert not wrong, "\n".join(wrong)


def test_the_core_imports_only_itself_and_the_settings():
    wrong = [f"{module_name(p)} imports {m}" for p in modules("ferry.core") for m in sorted(ferry_imports(p))
             if not any(under(m, a) for a in CORE_ALLOWED)]
    assert not wrong, "\n".join(wrong)


def test_the_core_runs_without_torch():
    imported = {m for p in modules("ferry.core") for m in _all_imports(p)}
    assert not {m for m in imported if under(m, "torch") or under(m, "numpy")}


def _all_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


# ---------------------------------------------------------------- the executor's contract
def _classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    """Every class in ferry/ and tests/, by name (nested ones too)."""
    out = {}
    for path in sorted(FERRY.rglob("*.py")) + sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (path, node))
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]


def _executor_classes() -> list[tuple[Path, ast.ClassDef]]:
    """Classes that run steps: they define ``execute(self, out)``."""
    found = []
    for path in sorted(FERRY.rglob("*.py")) + sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(f, ast.FunctionDef) and f.name == "execute" for f in node.body):
                found.append((path, node))
    return found


def test_every_executor_subclasses_the_base():
    classes = _classes()

    def is_executor(name: str, seen: frozenset = frozenset()) -> bool:
        if name == "Executor":
            return True
        if name not in classes or name in seen:
            return False
        return any(is_executor(b, seen | {name}) for b in _base_names(classes[name][1]))

    found = _executor_classes()
    names = {node.name for _, node in found}
    assert {"ModelExecutor", "TensorParallelExecutor", "SimulatedExecutor", "FakeExecutor"} <= names
    wrong = [f"{path.relative_to(ROOT)}: {node.name}" for path, node in found
             if node.name != "Executor" and not is_executor(node.name)]
    assert not wrong, "these run steps but do not subclass ferry.executor.base.Executor:\n" + "\n".join(wrong)


@pytest.mark.parametrize("where", ["ferry.executor.model_executor:ModelExecutor",
                                   "ferry.executor.tensor_parallel:TensorParallelExecutor",
                                   "ferry.executor.simulated:SimulatedExecutor",
                                   "ferry.sim.calibrate:_TimedExecutor", "tests.fakes:FakeExecutor"])
def test_every_executor_implements_the_whole_base(where):
    from ferry.executor.base import Executor

    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, Executor) and not cls.__abstractmethods__
    for member in ("execute", "check_sampling_params", "hold_grammar", "set_profiler", "close", "max_window",
                   "max_model_len", "num_kv_blocks", "tokenizer", "eos_token_ids", "vocab_size", "model_config",
                   "device", "dtype_name", "grammars"):
        assert hasattr(cls, member), f"{name} lacks {member}"


def test_the_engine_never_probes_its_executor():
    """No getattr/hasattr on an executor anywhere in ferry/engine: it uses the base's members."""
    probes = []
    for path in sorted((FERRY / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr") and node.args \
                    and "executor" in ast.unparse(node.args[0]):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "\n".join(probes)

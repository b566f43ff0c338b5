"""Load a benchmark script (`benchmarks/NAME.py`, not a package) as a module for its tests."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def load_script(relative: str, module_name: str | None = None) -> ModuleType:
    """`relative` is the path under benchmarks/ without ".py" ("sim_validate", "gpu/proof")."""
    name = module_name or relative.replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{relative}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module

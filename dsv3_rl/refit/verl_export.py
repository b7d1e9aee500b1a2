"""verl's Megatron-engine export path, importable without Ray, vLLM, Transformer Engine or tensordict.

``import verl`` runs ``verl/__init__.py``, which imports ``verl.protocol`` and with it Ray; the modules the
export needs (``verl.utils.megatron_utils.per_tensor_generator``, the DeepSeek-V3 weight converter, the FP8
quantizer of ``verl.utils.fp8_utils``) only need torch, megatron-core and transformers. ``load()`` imports
exactly those modules from verl's source tree, unmodified, with the package ``__init__`` files of their
parents skipped and three imports that drag in Ray/tensordict/omegaconf replaced: the two functions the
export calls (``normalize_model_name``, ``ensure_async_iterator``) are taken from verl's own source text,
and ``verl.workers.config`` (type annotations only) gets placeholder classes. Where the real ``verl``
package is already imported (the CPU suite), that one is used.

This is what lets bench/bench_refit.py run on the GPU box (torch + megatron-core, no Ray).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv3_rl.errors import Dsv3Error

REPO = Path(__file__).resolve().parents[2]

# parents whose __init__ imports Ray/tensordict/omegaconf (or everything): registered as bare packages
_BARE = ("verl", "verl.utils", "verl.models", "verl.models.mcore", "verl.workers", "verl.workers.rollout")
# module -> (verl source file, functions taken from it)
_FROM_SOURCE = {
    "verl.utils.model": ("utils/model.py", ("normalize_model_name",)),
    "verl.workers.rollout.utils": ("workers/rollout/utils.py", ("ensure_async_iterator",)),
}
_PLACEHOLDERS = {"verl.workers.config": ("HFModelConfig", "McoreEngineConfig")}


class VerlNotFound(Dsv3Error, ImportError):
    """No verl source tree to import the export path from (the message says where it looked)."""


@dataclass
class VerlExport:
    per_tensor_generator: Any
    DeepseekV3Converter: Any
    FP8QuantizerHelper: Any
    scaled_fp8_blockwise: Any
    light: bool
    root: Path


def verl_root() -> Path:
    """The ``verl`` package directory: the installed one, else backends/verl-*/verl of this checkout."""
    spec = importlib.util.find_spec("verl") if "verl" not in sys.modules else sys.modules["verl"].__spec__
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    found = sorted(REPO.glob("backends/verl-*/verl"))
    if not found:
        raise VerlNotFound(f"verl not installed and no backends/verl-*/verl under {REPO} (run `make backends`)")
    return found[-1]


def _functions_from_source(modname: str, path: Path, names: tuple[str, ...]) -> types.ModuleType:
    tree = ast.parse(path.read_text(), filename=str(path))
    body = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in names]
    missing = set(names) - {n.name for n in body}
    if missing:
        raise VerlNotFound(f"{path}: no function {', '.join(sorted(missing))} (verl version changed?)")
    mod = types.ModuleType(modname)
    mod.__file__ = str(path)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), mod.__dict__)
    return mod


def _install_light(root: Path) -> None:
    for name in _BARE:
        if name in sys.modules:
            continue
        mod = types.ModuleType(name)
        mod.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        mod.__file__ = None
        sys.modules[name] = mod
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, mod)
    for modname, (rel, names) in _FROM_SOURCE.items():
        sys.modules.setdefault(modname, _functions_from_source(modname, root / rel, names))
    for modname, classes in _PLACEHOLDERS.items():
        if modname not in sys.modules:
            mod = types.ModuleType(modname)
            for c in classes:
                setattr(mod, c, type(c, (), {"__doc__": "placeholder (dsv3_rl.refit.verl_export)"}))
            sys.modules[modname] = mod


def import_module(name: str):
    """One verl module whose own imports are torch/megatron only (e.g. ``verl.utils.megatron.router_replay_patch``):
    the real package where Ray is installed, else with verl's package ``__init__`` files skipped."""
    if "verl" not in sys.modules and importlib.util.find_spec("ray") is None:
        _install_light(verl_root())
    return importlib.import_module(name)


def load(light: bool = False) -> VerlExport:
    """verl's export pieces. LIGHT skips Ray (and stays in effect for this process: another part of the same
    process cannot import the real ``verl`` afterwards, so only a process of its own, such as the bench,
    asks for it)."""
    root = verl_root()
    real = "verl" in sys.modules and getattr(sys.modules["verl"], "__file__", None)
    if light and real:
        raise RuntimeError("the real verl package is already imported in this process; use light=False")
    if light:
        _install_light(root)
    mu = importlib.import_module("verl.utils.megatron_utils")
    wc = importlib.import_module("verl.models.mcore.weight_converter")
    fp8 = importlib.import_module("verl.utils.fp8_utils")
    kern = importlib.import_module("verl.utils.kernel.fp8_kernel")
    return VerlExport(mu.per_tensor_generator, wc.McoreToHFWeightConverterDpskv3, fp8.FP8QuantizerHelper,
                      kern.scaled_fp8_blockwise, light, root)

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

``load_engine()`` goes further, for bench/bench_grpo_update.py: verl's Megatron training engine
(``verl.workers.engine``: MegatronEngine, its config dataclasses, ``ppo_loss``, the GRPO advantage) needs
tensordict, omegaconf and codetiming (small wheels, carried to the GPU box in ``.whl/``) and imports modules
that ``import ray`` at module level (``verl.protocol``, ``verl.single_controller``, ``verl.utils.distributed``,
the checkpoint engines) without calling Ray on the engine's path. Where Ray is not installed (the GPU box: it
is too big to carry) ``install_ray_stub()`` registers a stand-in ``ray`` package that provides what those
modules touch at import time (``@ray.remote`` returns the class or function unchanged, any other attribute is
another stand-in) and raises, naming this module, if anything actually calls into Ray. Where Ray is
installed nothing is replaced.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
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


class RayNotInstalled(RuntimeError):
    """verl code tried to use Ray in a process where only the import-time stand-in exists."""


class _RayStandIn:
    """One attribute of the stand-in ``ray``: decorator use passes through, anything else is another
    stand-in; calling it with other arguments (a real Ray call) raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _RayStandIn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _RayStandIn(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        if self._name == "ray.remote":
            if len(args) == 1 and not kwargs and callable(args[0]):
                return args[0]  # @ray.remote
            return lambda obj: obj  # @ray.remote(num_cpus=...)
        raise RayNotInstalled(f"{self._name}() called, but Ray is not installed here; dsv3_rl.refit.verl_export "
                              "only stands in for Ray's import-time names (install ray to run this code path)")

    def __mro_entries__(self, bases):  # class X(ray.SomeBase)
        return (object,)

    def __getitem__(self, item):  # ray.ObjectRef[...] in annotations
        return self

    def __or__(self, other):  # ray.ObjectRef | None in annotations
        return self

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<stand-in for {self._name} (Ray not installed)>"


class _RayModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _RayStandIn(f"{self.__name__}.{attr}")


class _RayFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "ray" or name.startswith("ray."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _RayModule(spec.name)
        mod.__path__ = []
        mod.__doc__ = "import-time stand-in for Ray (dsv3_rl.refit.verl_export.install_ray_stub)"
        mod.RAY_STAND_IN = True
        return mod

    def exec_module(self, module):
        pass


def install_ray_stub() -> bool:
    """Register the import-time stand-in for ``ray`` where Ray is not installed; True if it is in place."""
    if any(isinstance(f, _RayFinder) for f in sys.meta_path):
        return True
    marked = "ray" in sys.modules and sys.modules["ray"] is None  # sys.modules["ray"] = None: "not installed"
    if not marked and ("ray" in sys.modules or importlib.util.find_spec("ray") is not None):
        return False
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _RayFinder())
    return True


def load_engine():
    """verl's package with its Megatron training engine importable; Ray stood in for where it is not
    installed. Returns ``(verl.workers.engine.megatron.transformer_impl, ray_stand_in)``."""
    if "verl" in sys.modules and not getattr(sys.modules["verl"], "__file__", None):
        raise RuntimeError("verl was imported by the light export loader in this process; load_engine() first")
    stub = install_ray_stub()
    verl_root()  # fails with VerlNotFound naming where it looked
    if importlib.util.find_spec("verl") is None:
        sys.path.insert(0, str(verl_root().parent))
    return importlib.import_module("verl.workers.engine.megatron.transformer_impl"), stub


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

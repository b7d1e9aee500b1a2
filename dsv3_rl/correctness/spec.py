"""Which megatron layer spec a run uses (Transformer Engine or local), and fp32 without TF32.

``--spec auto|te|local`` of the correctness suite and the replay check: ``auto`` is what the model builder
does by itself (``dsv3_rl.mcore.runtime.have_te()``: megatron-core's HAVE_TE), ``te`` demands Transformer
Engine and fails in one line naming why it does not import, ``local`` is megatron's TE-free spec.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from dsv3_rl.correctness import data


SPECS = ("auto", "te", "local")


def resolve_spec(spec: str) -> str:
    """``auto`` -> ``te`` where Transformer Engine imports (megatron-core's HAVE_TE, as the model builder
    decides), else ``local``; ``te`` without TE is a usage error naming why the import failed."""
    if spec not in SPECS:
        raise ValueError(f"spec {spec!r}: allowed {', '.join(SPECS)}")
    from dsv3_rl.mcore.runtime import have_te

    try:
        te = have_te()
    except Exception:  # noqa: BLE001 -- a TE that raises on import (e.g. a cuDNN mismatch) is not usable: say why
        te = False
    if spec == "auto":
        return "te" if te else "local"
    if spec == "te" and not te:
        raise ValueError(f"--spec te: Transformer Engine is not usable here ({te_import_error()}); "
                         f"install it (scripts/gpu_session.sh installs the carried .gpu-te bundle) or use --spec local")
    return spec


def te_import_error() -> str:
    """One line: why ``import transformer_engine.pytorch`` fails (or its version when it does not)."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401 -- what megatron-core's TE extension needs
    except Exception as e:  # noqa: BLE001 -- any failure is the answer, named
        return f"import transformer_engine.pytorch: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return f"transformer_engine {transformer_engine.__version__} imports, but megatron-core's HAVE_TE is false"


def tf32_off(dtype: str, out: Callable[[str], None] = print) -> None:
    """fp32 compares exact fp32 math: TF32 off for torch's matmuls and cuDNN, and NVIDIA_TF32_OVERRIDE=0 in the
    environment (inherited by the workers, read by cuBLAS/cuDNN when they initialise) for Transformer Engine's
    GEMMs, which request TF32 for fp32 inputs themselves and ignore torch's flags."""
    data.no_tf32()
    if dtype != "fp32":
        return
    before = os.environ.get("NVIDIA_TF32_OVERRIDE")
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    if torch.cuda.is_available():
        # the CLI sets it first thing; set here after CUDA started, it still reaches the workers (new processes)
        late = " (set after CUDA initialised in this process: it applies to the worker processes)" if (
            before != "0" and torch.cuda.is_initialized()) else ""
        out(f"fp32: TF32 off (torch.backends.cuda.matmul.allow_tf32=False, torch.backends.cudnn.allow_tf32=False, "
            f"NVIDIA_TF32_OVERRIDE=0 for cuBLAS/cuDNN and Transformer Engine's GEMMs){late}")


def te_status() -> tuple[bool, str]:
    """(usable, one line): Transformer Engine's version and the cuDNN it loaded, and whether megatron-core takes
    it (HAVE_TE); or why not. ``python -m dsv3_rl.correctness.spec`` prints the line (exit 1 when unusable)."""
    try:
        from dsv3_rl.mcore.runtime import have_te

        ok = have_te()
    except Exception as e:  # noqa: BLE001 -- whatever megatron's TE import raises is the answer
        return False, f"te: not usable: megatron-core's TE extension raised {type(e).__name__}: {str(e)[:200]}"
    if not ok:
        return False, f"te: not usable: {te_import_error()}"
    import transformer_engine
    from transformer_engine.pytorch.utils import get_cudnn_version

    try:
        cudnn = ".".join(map(str, get_cudnn_version()))
    except Exception as e:  # noqa: BLE001 -- reported, not fatal: the spec itself imported
        cudnn = f"unknown ({type(e).__name__})"
    return True, (f"te: transformer_engine {transformer_engine.__version__}, cuDNN {cudnn} (torch built with "
                  f"{torch.backends.cudnn.version()}), megatron-core HAVE_TE=True")


if __name__ == "__main__":
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    usable, line = te_status()
    print(line, flush=True)
    sys.exit(0 if usable else 1)

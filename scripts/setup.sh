#!/usr/bin/env bash
# make setup: a .venv with torch, the *patched* backends installed editable, their CPU-installable
# dependencies, and this package. Re-runnable: each step checks before it installs.
#
# Env: PYTHON (default python3), VENV (default .venv), TORCH_SPEC (default "torch>=2.6"),
#      TORCH_INDEX_URL (CPU machines; default the PyTorch CPU wheel index), SETUP_EXTRAS (e.g. "gpu").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch>=2.6}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
PIP_Q=${PIP_Q:--q}

say() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PYTHON --version)"
  $PYTHON -m venv "$VENV"
fi
PY="$VENV/bin/python"
# megatron-core's setup.py runs a bare `python3 -m pybind11`: the venv must come first on PATH.
PATH="$(cd "$VENV/bin" && pwd):$PATH"
export PATH
pip_install() {
  local rc=0
  "$PY" -m pip install $PIP_Q "$@" > >(grep -v "is ignored: it is neither" || true) 2>&1 || rc=$?
  wait
  if [ "$rc" -ne 0 ]; then echo "[setup] ERROR: pip install $* failed (exit $rc)" >&2; return "$rc"; fi
}

# 1. torch: keep what is there (a CUDA build on a GPU machine stays); else a CPU wheel when no GPU.
if "$PY" -c "import torch" 2>/dev/null; then
  say "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed, kept"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "installing $TORCH_SPEC (GPU machine)"
  pip_install "$TORCH_SPEC"
else
  # CPU machine: the CPU wheel index first (a plain PyPI torch is a multi-GB CUDA build);
  # pip still consults local find-links/mirrors when that index is unreachable.
  say "installing $TORCH_SPEC (CPU build, index $TORCH_INDEX_URL)"
  pip_install --retries 0 --timeout 10 "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL" \
    || { say "CPU index unreachable; trying the default index / local mirror"; pip_install "$TORCH_SPEC"; }
fi

# 2. build helpers megatron-core's editable install needs (no build isolation: it compiles one
#    optional C++ helper against pybind11).
pip_install "setuptools>=64,<80" wheel pybind11 "packaging>=24.2"

# 3. pinned backends, fetched by hash and patched.
"$PY" -m pip show dsv3-rl >/dev/null 2>&1 || pip_install --no-deps -e .
"$PY" -m dsv3_rl.patching fetch
"$PY" -m dsv3_rl.patching apply

# 4. dependencies: verl's CPU-installable requirements (transformers within its range), ours, test tools.
pip_install -r scripts/requirements-cpu.txt

# 5. the patched backends, editable, so the code that runs is backends/<name>-<version>/.
for b in megatron-core verl; do
  dir=$("$PY" -c "from dsv3_rl.backends import load_lock; print(load_lock()['$b'].path())")
  want="$dir"
  have=$("$PY" - "$b" <<'PYEOF' 2>/dev/null || true
import importlib.metadata as md, json, sys
d = md.distribution(sys.argv[1])
t = d.read_text("direct_url.json")
print(json.loads(t)["url"].removeprefix("file://") if t else "")
PYEOF
)
  if [ "$have" = "$want" ]; then
    say "$b: editable from $dir, kept"
  else
    say "$b: installing editable from $dir"
    pip_install --no-deps --no-build-isolation -e "$dir"
  fi
done
pip_install --no-deps -e .

if [ "${SETUP_EXTRAS:-}" = "gpu" ]; then
  say "GPU extras: see docs/gpu-setup.md (vLLM, Transformer Engine, flash-attn are cluster-image choices)"
  pip_install -r scripts/requirements-gpu.txt
fi

"$PY" - <<'PYEOF'
import importlib.metadata as md, platform
import torch
v = lambda n: md.version(n)
print(f"[setup] done: python {platform.python_version()}, torch {torch.__version__} "
      f"({'cuda ' + torch.version.cuda if torch.cuda.is_available() else 'cpu'}), megatron-core {v('megatron-core')}, "
      f"verl {v('verl')}, transformers {v('transformers')}, dsv3-rl {v('dsv3-rl')}")
PYEOF

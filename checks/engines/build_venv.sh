#!/usr/bin/env bash
# Build the venv the engine checks run in, once, outside the clone; print its path as the last line.
#
#   checks/engines/build_venv.sh          # -> ~/.cache/toposched/engines-venv-<hash>
#
# The venv is keyed by a hash of requirements.txt, the GPU stub package and this script, so it is
# rebuilt only when one of them changes (older venvs are removed then). It is built in a temporary
# folder and renamed into place when complete, so an interrupted build is never reused.
# TOPOSCHED_ENGINES_CACHE overrides the cache folder, PYTHON the interpreter (Python 3.11: SGLang's
# wheel is cp311). On failure it says why in one line and exits 1.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
cache=${TOPOSCHED_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/toposched}

fail() {
    echo "check-engines: $*" >&2
    exit 1
}

command -v "$python" >/dev/null || fail "no $python to build the engines venv with (set PYTHON)"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$version" = 3.11 ] || fail "the engines venv needs Python 3.11 (SGLang 0.5.23 ships a cp311 wheel), $python is $version"

hash=$(cd "$here" && cat requirements.txt build_venv.sh gpu_stub/pyproject.toml gpu_stub/toposched_gpu_stub/*.py \
    | sha256sum | cut -c1-16)
venv="$cache/engines-venv-$hash"
if [ -f "$venv/.complete" ]; then
    echo "$venv"
    exit 0
fi

mkdir -p "$cache"
work=$(mktemp -d "$cache/.engines-venv-build.XXXXXX")
log="$cache/engines-venv-build.log"
trap 'rm -rf "$work"' EXIT
echo "check-engines: building the engines venv (vLLM 0.33.0, SGLang 0.5.23, CPU torch) in $venv; log: $log" >&2
started=$(date +%s)

pip_step() {  # pip_step WHAT ARGS...: run pip in the new venv, one line on failure
    local what=$1
    shift
    if ! "$work/bin/python" -m pip --disable-pip-version-check --timeout 60 --retries 3 "$@" >>"$log" 2>&1; then
        tail -n 15 "$log" >&2
        fail "cannot build the engines venv: $what failed (full log: $log)"
    fi
}

: >"$log"
"$python" -m venv "$work" >>"$log" 2>&1 || fail "python -m venv failed (full log: $log)"
if grep -q '^torch==.*+cpu' "$here/requirements.txt"; then
    torch=$(grep '^torch==' "$here/requirements.txt")
    pip_step "installing $torch (the CPU build is looked up on pip's find-links, /opt/wheels on this image)" \
        install --no-deps --no-compile "$torch"
fi
pip_step "pip install --no-deps -r requirements.txt (is PyPI reachable?)" \
    install --no-deps --no-compile -r "$here/requirements.txt"
cp -r "$here/gpu_stub" "$work/.gpu_stub-src"  # pip builds in the source folder: not in the clone
pip_step "installing the GPU stub (gpu_stub/)" install --no-deps --no-compile "$work/.gpu_stub-src"
rm -rf "$work/.gpu_stub-src"
"$work/bin/python" -m pip --disable-pip-version-check check >>"$log" 2>&1 || true  # the CUDA pins are missing on purpose
"$work/bin/pip" freeze --all >"$work/.complete"

# The venv's scripts name their interpreter by path: build where it will live, then move the finished
# folder there (fix the paths pip wrote).
rm -rf "$venv"
mv "$work" "$venv"
trap - EXIT
grep -rlF "$work" "$venv/bin" 2>/dev/null | xargs -r sed -i "s#$work#$venv#g"
for old in "$cache"/engines-venv-*; do
    if [ -d "$old" ] && [ "$old" != "$venv" ]; then
        rm -rf "$old"
    fi
done
echo "check-engines: engines venv built in $(($(date +%s) - started)) s" >&2
echo "$venv"

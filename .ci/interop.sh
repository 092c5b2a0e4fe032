#!/usr/bin/env bash
# `make test-interop`: each protocol's tests in their own venv (docs/interop.md).
#
# The protocol packages pin versions labrl's own venv cannot hold (openenv and openreward
# pin mcp and sse-starlette, MADSci wants pydantic 2.13), so each tests/interop/NAME gets
# .venv-interop/NAME, layered over the main venv: a _main_site.pth adds the main venv's
# site-packages with site.addsitedir (so its own .pth files, labrl's editable install among
# them, are processed too) AFTER the venv's own site-packages, so the protocol's pins shadow
# the main venv's copies while labrl, torch and the rest are not reinstalled. A venv is
# rebuilt only when its requirements.txt changes (the hash is stamped in the venv).
set -uo pipefail
cd "$(dirname "$0")/.."
MAIN_VENV=${VENV:-.venv}
MAIN_PYTHON="$MAIN_VENV/bin/python"
PYTHON=${PYTHON:-python3}
if [ ! -x "$MAIN_PYTHON" ]; then
    echo "interop: $MAIN_PYTHON not found; run 'make test' (or build $MAIN_VENV) first" >&2
    exit 2
fi
MAIN_SITE=$("$MAIN_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

build_venv() {  # NAME REQUIREMENTS: create or reuse .venv-interop/NAME
    local name=$1 requirements=$2 venv=".venv-interop/$1"
    local want have
    want=$(sha256sum "$requirements" | cut -d' ' -f1)
    have=$(cat "$venv/.requirements-sha256" 2>/dev/null || true)
    if [ "$want" = "$have" ]; then
        echo "interop[$name]: venv up to date ($venv)"
        return 0
    fi
    echo "interop[$name]: building $venv from $requirements"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" || return 1
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    echo "import site; site.addsitedir('$(cd "$MAIN_SITE" && pwd)')" > "$site/_main_site.pth"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --ignore-installed -r "$requirements" || return 1
    echo "$want" > "$venv/.requirements-sha256"
}

failed=()
for requirements in tests/interop/*/requirements.txt; do
    name=$(basename "$(dirname "$requirements")")
    started=$SECONDS
    if build_venv "$name" "$requirements" \
        && ".venv-interop/$name/bin/python" -m pytest -p no:cacheprovider "tests/interop/$name"; then
        echo "interop[$name]: PASSED in $((SECONDS - started)) s"
    else
        echo "interop[$name]: FAILED in $((SECONDS - started)) s"
        failed+=("$name")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "interop: failed: ${failed[*]}"
    exit 1
fi
echo "interop: all passed"

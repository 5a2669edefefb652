#!/usr/bin/env bash
# Builds the JupyterLab extension into workbench/labextension/ when its sources changed, and links it
# into the venv's labextensions directory. `make extension` (and so `make lab`) calls this.
#
# "Changed" is a content hash over the sources (src/, style/, package.json, package-lock.json,
# tsconfig.json), stored next to the output. The output is committed and ships in the wheel, so a
# checkout without Node still gets a working extension: with no Node, a stale build is kept with a warning.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-../.venv}
OUT=../workbench/labextension
NAME=parallel-workbench-lab

sources_hash() {
  find src style -type f \( -name '*.ts' -o -name '*.css' -o -name '*.js' \) | LC_ALL=C sort \
    | xargs cat package.json package-lock.json tsconfig.json | sha256sum | cut -d' ' -f1
}

want=$(sources_hash)
have=$(cat "$OUT/sources.sha256" 2>/dev/null || true)
if [ "$want" != "$have" ] || [ ! -f "$OUT/package.json" ]; then
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "warning: extensions/ changed but Node/npm is not installed; using the prebuilt extension in workbench/labextension" >&2
  else
    echo "Building the JupyterLab extension (extensions/ -> workbench/labextension/)"
    if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
      npm ci --no-audit --no-fund --loglevel=error
    fi
    npx tsc
    core=$("$VENV/bin/python" -c "import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), 'staging', 'package.json'))")
    rm -rf "$OUT"
    if [ -x "$VENV/bin/jupyter-builder" ]; then  # JupyterLab >= 4.6
      PATH="$VENV/bin:$PATH" "$VENV/bin/jupyter-builder" build --core-package-file="$core" .
    else
      PATH="$VENV/bin:$PATH" "$VENV/bin/jupyter" labextension build --core-path="$(dirname "$core")" .
    fi
    # Tells `jupyter labextension list` which Python package ships it.
    printf '%s\n' '{"packageManager": "python", "packageName": "parallel-workbench", "uninstallInstructions": "pip uninstall parallel-workbench"}' > "$OUT/install.json"
    echo "$want" > "$OUT/sources.sha256"
  fi
fi

# The venv sees the build through a link, so a rebuild needs no reinstall (what `labextension develop` does).
dest="$VENV/share/jupyter/labextensions/$NAME"
if [ "$(readlink "$dest" 2>/dev/null)" != "$(cd "$OUT" && pwd)" ]; then
  mkdir -p "$(dirname "$dest")"
  rm -rf "$dest"
  ln -s "$(cd "$OUT" && pwd)" "$dest"
fi

#!/usr/bin/env bash
# `make deploy-check`: render every Kustomize overlay, validate it strictly and offline against the
# Kubernetes schemas bundled by kubernetes-validate, check the deployment's policies
# (deploy/lint_manifests.py) and lint the Dockerfiles' intent (deploy/lint_dockerfiles.py).
# Exits non-zero on any finding.
#
#   deploy/check.sh [K8S_DIR]        K8S_DIR defaults to deploy/k8s (holds base/ and overlays/)
#   PYTHON=...        interpreter with kubernetes-validate and PyYAML (default .venv/bin/python)
#   K8S_VERSIONS=...  Kubernetes versions to validate against (default "1.30.0 1.37.0": the oldest
#                     with everything used here, preStop sleep among it, and the newest bundled)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
K8S_DIR="$(cd "${1:-$ROOT/deploy/k8s}" && pwd)"
K8S_VERSIONS="${K8S_VERSIONS:-1.30.0 1.37.0}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

fail() { echo "deploy-check: $*" >&2; exit 1; }

command -v kubectl >/dev/null || fail "kubectl not found: it renders the overlays (kubectl kustomize)"
"$PYTHON" -c "import kubernetes_validate, yaml" 2>/dev/null \
  || fail "$PYTHON lacks kubernetes-validate: run 'make setup' (or pip install -r requirements.txt)"

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

shopt -s nullglob
overlays=("$K8S_DIR"/overlays/*/)
(( ${#overlays[@]} > 0 )) || fail "no overlays under $K8S_DIR/overlays"

rendered=()
for overlay in "${overlays[@]}"; do
  name="$(basename "$overlay")"
  kubectl kustomize "$overlay" > "$OUT/$name.yaml" 2> "$OUT/$name.err" \
    || fail "kubectl kustomize $overlay failed: $(cat "$OUT/$name.err")"
  count="$(grep -c '^kind:' "$OUT/$name.yaml" || true)"
  (( count > 0 )) || fail "overlay $name renders no objects"
  for version in $K8S_VERSIONS; do
    # Unknown kinds only WARN in kubernetes-validate; here every object must have a schema.
    if ! "$PYTHON" -m kubernetes_validate --strict --quiet -k "$version" "$OUT/$name.yaml" > "$OUT/$name.log" 2>&1 \
        || grep -qE '^(WARN|ERROR|FATAL)' "$OUT/$name.log"; then
      cat "$OUT/$name.log" >&2
      fail "overlay $name does not validate against Kubernetes $version"
    fi
  done
  echo "deploy-check: overlay $name: $count objects valid (strict) against Kubernetes ${K8S_VERSIONS// /, }"
  rendered+=("$OUT/$name.yaml")
done

"$PYTHON" "$ROOT/deploy/lint_manifests.py" "${rendered[@]}" || fail "manifest policy checks failed"
"$PYTHON" "$ROOT/deploy/lint_dockerfiles.py" || fail "Dockerfile lint failed"
echo "deploy-check: OK"

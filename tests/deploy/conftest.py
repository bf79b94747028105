"""Rendering and validating the Helm chart in deploy/helm/userdp, without a cluster.

The chart is rendered by Helm's own engine (the ``helm-python-sdk`` package binds Helm v4's Go
SDK; no ``helm`` binary needed) and every object is validated against the Kubernetes OpenAPI
schemas bundled by ``kubernetes-validate``. Both are in the ``[dev]`` extra; a test that needs one fails, naming
it, when it is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "userdp"
RELEASE = "demo"
NAMESPACE = "userdp-test"
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema bundled.
KUBE_VERSIONS = ("1.28", "1.37")


class Rendered(list):
    """The rendered objects, with look-ups by kind and name."""

    def find(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        """The one object of ``kind`` whose name ends with ``name_suffix``."""
        matches = [
            o for o in self if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)
        ]
        assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {len(matches)}"
        return matches[0]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self)

    @staticmethod
    def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
        return obj["spec"]["template"]["spec"]

    @staticmethod
    def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
        (match,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
        return match


def _need(module: str, package: str) -> None:
    # Fail, not skip: the test command installs [dev], so a missing package is a broken install
    # that would otherwise turn every chart check into a silent skip.
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{package} is not installed; install userdp's [dev] extra")


@pytest.fixture
def render_chart() -> Callable[..., Rendered]:
    """``render(values=None, release=RELEASE) -> [object, ...]`` with Helm's template engine."""
    _need("helm_python", "helm-python-sdk (Helm's template engine)")
    import helm_python

    def render(values: dict[str, Any] | None = None, release: str = RELEASE) -> Rendered:
        with helm_python.Chart.load(str(CHART_DIR)) as chart:
            files = chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
        objects = Rendered()
        for path, text in sorted(files.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        return objects

    return render


@pytest.fixture
def validate_k8s() -> Callable[[dict[str, Any]], None]:
    """Validate one object against the Kubernetes OpenAPI schemas (strict: unknown fields fail)."""
    _need("kubernetes_validate", "kubernetes-validate (Kubernetes OpenAPI schemas)")
    import kubernetes_validate

    def validate(obj: dict[str, Any]) -> None:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)

    return validate

"""Fixtures shared by the PyTorch cross-checks: every (model, exporter) exported once per session."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "export_torch_models.py"
MODELS = ("gpt2", "bert", "t5", "llama", "vit", "resnet")
EXPORTERS = ("legacy", "dynamo")


def _script():
    spec = importlib.util.spec_from_file_location("export_torch_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def script():
    return _script()


@pytest.fixture(scope="session")
def exports(tmp_path_factory, script) -> tuple[Path, dict]:
    """Every (model, exporter) exported once: the folder and the script's results."""
    exporters = list(EXPORTERS)
    if importlib.util.find_spec("onnxscript") is None:
        exporters.remove("dynamo")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("torch_exports")
    return out, script.export_all(out, list(MODELS), exporters)


@pytest.fixture
def case(request, exports) -> dict:
    """The JSON the export script wrote for this case, with the folder under "dir"."""
    out, results = exports
    key = request.param
    if key not in results:
        pytest.skip(f"{key}: exporter not available (the dynamo exporter needs onnxscript)")
    info = results[key]
    if isinstance(info, str):
        pytest.fail(f"{key}: torch export failed: {info}")
    return {**info, "dir": out}

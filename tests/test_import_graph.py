"""The package's shape, checked mechanically so it stays true (see ``scripts/import_graph.py``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

from tapllm.engine.request import Request

ROOT = Path(__file__).resolve().parent.parent


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_no_circle_no_upward_import_and_a_leaf_tap_package():
    assert _import_graph().violations() == []


def test_the_checker_sees_circles_upward_imports_leaf_breaches_and_unplaced_modules(tmp_path):
    graph = _import_graph()
    pkg = tmp_path / "tapllm"
    for name, text in {"__init__.py": "", "tap/__init__.py": "from tapllm.engine import x\n",
                       "engine/__init__.py": "from tapllm import llm\n", "llm.py": "import tapllm.engine\n",
                       "stray.py": ""}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    found = graph.violations(pkg)
    assert any(v.startswith("circle: tapllm.engine <-> tapllm.llm") for v in found)
    assert any(v.startswith("upward (run): tapllm.engine:1 imports tapllm.llm") for v in found)
    assert any(v.startswith("leaf: tapllm.tap:1 imports tapllm.engine") for v in found)
    assert "unplaced: tapllm.stray is in no layer of LAYERS" in found


def test_layers_list_each_package_once_and_none_inside_another(monkeypatch):
    graph = _import_graph()
    assert graph.layer_errors() == []
    monkeypatch.setattr(graph, "LAYERS", [("tapllm.tap",), ("tapllm.sae", "tapllm.tap"), ("tapllm.sae.cli",)])
    assert graph.layer_errors() == ["layers: tapllm.tap is listed twice",
                                    "layers: tapllm.sae.cli lies inside tapllm.sae, whose modules share its layer"]


def test_no_engine_file_is_over_400_lines():
    long = {p.name: n for p in (ROOT / "tapllm" / "engine").glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_request_has_no_field_typed_object():
    loose = [f.name for f in dataclasses.fields(Request) if "object" in str(f.type) or "Any" in str(f.type)]
    assert loose == []

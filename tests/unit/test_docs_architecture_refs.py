"""Every file path and code name docs/architecture.md cites exists (the doc drifts otherwise).

Paths: backticked tokens ending in a file suffix (``scheduler/jobs/service.py``), relative to the
repository root. Names: a backticked path followed by backticked identifiers
(```worker/engine/engine.py` `BlockDiffusionEngine```): each must be defined (class, function,
assignment) or imported at the top level of that file, or be one of its attributes/methods.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|md|yaml|yml|toml|ini|json|html|js|css))`")
PAIR = re.compile(r"`((?:[\w-]+/)+[\w.-]+\.py)`((?:\s*`[A-Za-z_][\w.]*(?:\(\))?`)+)")
NAME = re.compile(r"`([A-Za-z_][\w.]*)(?:\(\))?`")


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            names |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name | ast.Attribute):
            names.add(node.target.id if isinstance(node.target, ast.Name) else node.target.attr)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _exists(cited: str) -> bool:
    return (ROOT / cited).exists()


def test_cited_paths_exist() -> None:
    cited = sorted(set(PATH.findall(DOC.read_text())))
    assert len(cited) > 50  # the doc cites files throughout; an empty match means the regex broke
    missing = [p for p in cited if "/" in p and not _exists(p)]
    assert missing == []


def test_cited_names_are_defined_in_their_file() -> None:
    pairs = PAIR.findall(DOC.read_text())
    assert len(pairs) > 10
    missing = []
    for path, names in pairs:
        if not _exists(path):
            missing.append(path)
            continue
        defined = _defined(ROOT / path)
        missing += [f"{path} {name}" for name in NAME.findall(names)
                    if name.split(".")[0] not in defined]
    assert missing == []

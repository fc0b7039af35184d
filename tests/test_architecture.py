"""The layout docs/architecture.md describes, held for the whole tree of the bundle's Python.

Every import counts -- at module level, inside functions and under ``TYPE_CHECKING`` -- because a circle that only
closes at run time still makes the order of imports matter and the modules impossible to read one at a time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
#: the stages in the order data flows; a module imports from its own stage or one before it, never one after
STAGES = ("common", "data", "training", "inference", "evaluation", "profiling")
#: the commands users type (``python -m scripts.<name>``), the only modules beside the stage packages
COMMANDS = {"prepare", "tcia", "cross_validation", "summarize_trace", "build_configs", "gpu_monitor", "synthetic"}
MAX_LINES = 1000


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SCRIPTS.rglob("*.py"))}


def bundle_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The bundle's modules ``path`` imports anywhere in its body (each name resolved to the module that defines it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the bundle imports by the full name"
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module or ""]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != "scripts":
                found.add(name)
    found.discard(module_name(path))
    return found


def stage_of(module: str) -> int:
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 2 or parts[1] in STAGES else len(STAGES)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: bundle_imports(path, known) for name, path in known.items()}


def test_the_import_graph_has_no_circle(graph):
    """Depth-first search over every import; a circle is printed as the modules that form it."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                circle = [*path[path.index(imported) :], imported]
                pytest.fail("import circle: " + " -> ".join(circle))
            if imported not in state:
                visit(imported)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports between them, no circle")


def test_no_stage_imports_a_later_one(graph):
    upward = [
        f"{module} -> {imported}"
        for module, imported_modules in graph.items()
        for imported in imported_modules
        if stage_of(imported) > stage_of(module)
    ]
    assert not upward, "imports from a later stage (move the shared piece down a stage):\n" + "\n".join(upward)


def test_the_top_of_scripts_holds_only_the_stages_and_the_commands():
    top = {p.stem for p in SCRIPTS.glob("*.py")} - {"__init__"}
    packages = {p.name for p in SCRIPTS.iterdir() if (p / "__init__.py").is_file()}
    assert top == COMMANDS, f"modules beside the stage packages: {sorted(top ^ COMMANDS)}"
    assert packages == set(STAGES)
    for stage in STAGES:
        assert f"scripts/{stage}/" in (ROOT / "docs/architecture.md").read_text(), f"{stage} missing from the page"


def test_no_module_is_over_its_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted([*SCRIPTS.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines (split by job): {long}"


def behaviourless(path: Path) -> bool:
    """A module of exception classes only: its messages are tested where they are raised."""
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, (ast.Expr, ast.ImportFrom, ast.ClassDef)) for node in body) and all(
        all(isinstance(item, ast.Expr) for item in node.body) for node in body if isinstance(node, ast.ClassDef)
    )


def test_each_module_has_its_test_file():
    """``scripts/<stage>/<path>.py`` is tested in ``tests/test_<path with _>.py``, or a sub-package's modules together
    in ``tests/test_<sub-package>.py``; the commands are tested through the stage module each one runs."""
    missing = []
    for name, path in modules().items():
        parts = name.split(".")[1:]
        if path.name == "__init__.py" or parts[0] in COMMANDS or behaviourless(path):
            continue
        tests = {"test_" + "_".join(parts[1:]) + ".py", f"test_{parts[1]}.py"}
        if not any((ROOT / "tests" / test).is_file() for test in tests):
            missing.append(f"{path.relative_to(ROOT)}: tests/{min(tests, key=len)}")
    assert not missing, "modules without their test file:\n" + "\n".join(missing)


def history_in(text: str, versions: set[str]) -> list[str]:
    """What in ``text`` says when rather than what: one of the bundle's versions, a date, an issue number, or which
    run of a machine measured something (those belong to CHANGELOG.md and docs/performance.md)."""
    series = {v.rsplit(".", 1)[0] for v in versions}
    patterns = [
        r"(?<![\w.])(?:" + "|".join(map(re.escape, versions)) + r")(?![\w.])",
        r"\b(?:since|before|after|until|as in|as of) (?:" + "|".join(map(re.escape, series)) + r")\b",
        r"\b20\d\d-[01]\d-[0-3]\d\b",
        r"\bissues? #?\d+",
        r"\b(?:first|second|third|fourth|last|next|previous) (?:H100|H200|MI300X?|GPU) run\b",
        r"\b(?:H100|H200|MI300X?|GPU) run of\b",
    ]
    return [m.group(0) for pattern in patterns for m in re.finditer(pattern, text, re.IGNORECASE)]


def test_code_says_what_and_why_not_when():
    """No bundle version, date, issue number or run history in the bundle's Python, the benchmarks or the configs;
    a constant chosen by a measurement names the docs/performance.md section it comes from."""
    versions = set(re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE))
    assert len(versions) > 10
    found = []
    for path in sorted([*SCRIPTS.rglob("*.py"), *(ROOT / "benchmarks").rglob("*"), *(ROOT / "configs").glob("*.yaml")]):
        if path.is_file() and path.suffix in {".py", ".yaml", ".sh"}:
            for hit in history_in(path.read_text(), versions):
                found.append(f"{path.relative_to(ROOT)}: {hit!r}")
    assert not found, "history in code (move it to CHANGELOG.md or docs/performance.md):\n" + "\n".join(found)

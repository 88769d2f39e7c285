"""The house rules of the layout, read from the code itself: one import name, and the product
never leaning on its operator tools or its stand-in clusters."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("tasks", "workers", "recovery", "delivery", "store", "core", "container", "artifacts", "ops", "demo", "lab")
PRODUCT = ("core", "store", "workers", "artifacts", "delivery", "recovery", "tasks", "container")
NOT_FOR_THE_PRODUCT = ("demo", "lab", "ops")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module name `path` imports, with its line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
            if node.module == "k8s_dispatch":
                found += [(node.lineno, f"k8s_dispatch.{alias.name}") for alias in node.names]
    return found


def python_files(*folders: str) -> list[Path]:
    files = [p for folder in folders for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts]
    assert files, folders
    return files


def test_every_import_of_our_folders_goes_through_k8s_dispatch() -> None:
    """A bare `import engine` would load a second copy of a module (and, installed, an engine's
    own `engine`): nothing of ours may use the top-level names."""
    top_level = {*FOLDERS, "celeryconfig"}
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in [*python_files(*FOLDERS, "tests", "k8s_dispatch"), REPO / "celeryconfig.py"]
        for line, module in imported_modules(path)
        if module.split(".")[0] in top_level
    ]
    assert bad == []


def test_the_layers_are_checked_by_import_linter() -> None:
    """Which package may import which is pyproject.toml's [tool.importlinter] (`make lint` runs
    `lint-imports`): the product never imports the demo or the lab, nothing imports upward, no
    package's modules import in a cycle. Here: every package of ours is in its layers."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    layered = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    ours = {f"k8s_dispatch.{folder}" for folder in FOLDERS if folder != "container"} | {"k8s_dispatch.celeryconfig"}
    assert ours - layered == set()


def test_the_import_name_links_every_folder() -> None:
    """In a checkout `k8s_dispatch/` links to the folders; the wheel copies them into it."""
    for folder in FOLDERS:
        link = REPO / "k8s_dispatch" / folder
        assert link.is_symlink() and link.resolve() == REPO / folder, link
    assert (REPO / "k8s_dispatch" / "celeryconfig.py").resolve() == REPO / "celeryconfig.py"


def test_test_modules_have_names_of_their_own() -> None:
    """The tests are imported by basename (no packages under tests/): two test_x.py in two
    folders stop the whole run at collection."""
    names = [p.name for p in (REPO / "tests").rglob("*.py") if "__pycache__" not in p.parts]
    repeated = sorted({n for n in names if names.count(n) > 1 and n != "conftest.py"})
    assert repeated == []


def test_one_writer_of_terminal_events() -> None:
    """Every end of a dispatch (completed, failed, cancelled, lost, timed out, given up by the
    sweep) is written through `delivery.terminal.record`: nothing else of the product calls the
    store's terminal-event writes."""
    writes = {"record_terminal", "record_terminals"}
    callers = sorted(
        str(path.relative_to(REPO))
        for path in python_files(*PRODUCT, "ops")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in writes
    )
    assert callers == ["delivery/terminal.py"]

"""Imports run one way: no module of relay/ (relay/adapters/ included) imports one that imports it back,
directly or through others; the core never imports an adapter or the CLI; adapters never
import the dispatch path or the CLI. Read from the source with ast, so a lazy import inside
a function counts as much as one at the top of a file."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("relay",)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from relay import errors`` is relay.errors)."""
    found: set[str] = set()
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .sub import y
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules and name != own}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check below could never fail if this did not.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_relay_and_adapters() -> None:
    graph = import_graph()
    assert len(graph) > 40, sorted(graph)  # the walk found the modules
    assert cycles(graph) == []


def test_the_core_imports_no_adapter_and_no_cli() -> None:
    graph = import_graph()
    # The CLI and the composition root wire the core to the adapters (through relay.wiring
    # and adapters.registry): they alone may. The registry itself names no adapter (it
    # imports one by name when it is chosen), so the core may ask it for the destinations'
    # names (--broker's choices).
    wiring = ("relay.cli", "relay.wiring", "relay.embed", "relay.compose")
    registry = "relay.adapters.registry"
    core = [m for m in graph if not m.startswith((*wiring, "relay.adapters"))]
    wrong = {
        m: sorted(d for d in graph[m] if d.startswith(("relay.adapters", "relay.cli")) and d != registry) for m in core
    }
    assert {m: d for m, d in wrong.items() if d} == {}
    assert [d for d in graph[registry] if d.startswith("relay.adapters")] == []


def test_adapters_import_only_the_core_contract_not_the_dispatch_path() -> None:
    graph = import_graph()
    # What an adapter may use of the core: the contract, the failure classes and the
    # message, the CloudEvents envelope the contract's PublishLimits names (how a message
    # reads as a CloudEvent, each adapter in its binding's way), the option engine, and
    # the text helpers that mask secrets.
    allowed = {
        "relay",
        "relay.contract",
        "relay.cloudevents",
        "relay.errors",
        "relay.message",
        "relay.options",
        "relay.dsn",
        "relay.textsafe",
    }
    wrong = {
        m: sorted(d for d in deps if not d.startswith("relay.adapters") and d not in allowed)
        for m, deps in graph.items()
        if m.startswith("relay.adapters")
    }
    assert {m: d for m, d in wrong.items() if d} == {}


def test_reading_the_brokers_options_loads_no_dispatch_path() -> None:
    # `relay --help` reads every broker's options: that must not pull in the worker, the
    # store, the database pool or an SDK.
    code = (
        "import sys, relay.adapters.registry; relay.adapters.registry.broker_options();"
        " loaded = [m for m in ('relay.worker', 'relay.db.dispatch', 'relay.config', 'psycopg_pool', 'aio_pika',"
        " 'boto3')"
        " if m in sys.modules]; print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_test_modules_share_helpers_not_each_other() -> None:
    # What several test modules use lives in a helper module (tests/relay_process.py,
    # helpers.py, deliveries.py, ...), so that running one test file never collects another.
    wrong = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_"):
                wrong.append(f"{path.name} imports {node.module}")
    assert wrong == []


def test_the_database_layer_imports_nothing_above_it() -> None:
    # relay/db names the statements and builds the rows; what it may use beside itself:
    # the failure classes, the masking of secrets, the message a claimed row becomes and
    # the ordering map a settings row holds. Nothing that decides or presents.
    graph = import_graph()
    allowed = {"relay", "relay.errors", "relay.dsn", "relay.textsafe", "relay.message", "relay.ordering"}
    wrong = {
        m: sorted(d for d in deps if not d.startswith("relay.db") and d not in allowed)
        for m, deps in graph.items()
        if m.startswith("relay.db")
    }
    assert {m: d for m, d in wrong.items() if d} == {}


def test_only_the_database_layer_reads_sql_files() -> None:
    graph = import_graph()
    readers = sorted(m for m, deps in graph.items() if "relay.db.statements" in deps and not m.startswith("relay.db"))
    assert readers == []


def test_the_running_relay_needs_nothing_of_the_operator_tools() -> None:
    # Everything `relay start` and relay.Relay load, followed through their imports.
    graph = import_graph()
    seen: set[str] = set()
    todo = ["relay.embed", "relay.runner", "relay.cli.start"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    assert sorted(m for m in seen if m.startswith(("relay.ops", "relay.console"))) == []

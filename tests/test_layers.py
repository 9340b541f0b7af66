"""Layering: each layer imports only those below it (DESIGN.md, docs/architecture.md);
`import batchplan` is light; readers of plans never load numba."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _modules import loaded_after


@pytest.mark.slow
def test_import_batchplan_is_light():
    assert loaded_after("import batchplan") == set()


@pytest.mark.slow
@pytest.mark.parametrize(
    "module",
    [
        "batchplan.formats.plan_file",
        "batchplan.formats.lengths",
        "batchplan.reports.summary",
        "batchplan.operations.validate",
    ],
)
def test_file_layer_does_not_import_numba(module):
    assert "numba" not in loaded_after(f"import {module}")


@pytest.mark.slow
def test_kernels_package_import_is_light():
    assert loaded_after("import batchplan.kernels") == set()


# What each layer may import (its own modules included), by folder; base = the modules
# directly in batchplan/ other than __init__ and toy (errors, config, plan, reduce).
ALLOWED = {
    "base": {"base"},
    "kernels": {"kernels"},
    "planning": {"base", "kernels", "planning"},
    "formats": {"base", "formats"},
    "reports": {"base", "kernels", "planning", "formats", "reports"},
    "operations": {"base", "kernels", "planning", "formats", "reports", "operations"},
    "runtime": {"base", "formats", "runtime"},
    "integrations": {"base", "formats", "runtime", "integrations"},
    "toy": {"base", "runtime", "toy"},  # the examples' model
}
PACKAGE = Path(__file__).resolve().parent.parent / "batchplan"


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "batchplan" or len(parts) == 1:
        return None  # outside batchplan, or the lazy top-level API
    return parts[1] if parts[1] in ALLOWED else "base"


def imported_modules(path: Path) -> set[str]:
    """Every batchplan module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "batchplan":
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            else:
                found |= {node.module}
    return {name for name in found if name.startswith("batchplan.")}


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        layer = layer_of(module)
        if layer is None or path.name == "__init__.py" and layer == "base":
            continue
        for name in sorted(imported_modules(path)):
            target = layer_of(name)
            if target is not None and target not in ALLOWED[layer]:
                wrong.append(f"{module} ({layer}) imports {name} ({target})")
    assert wrong == []


def module_imports() -> dict[str, set[str]]:
    """Each batchplan module (not the lazy top-level API) and the batchplan modules it imports,
    ``from batchplan.x import name`` counted as an import of ``batchplan.x.name`` when that is a
    module, else of ``batchplan.x``."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in modules.items():
        found = set()
        for name in imported_modules(path):
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules and name not in (module, "batchplan"):
                found.add(name)
        graph[module] = found
    return graph


def test_no_module_imports_itself_through_others():
    """No file-level import cycle, at module level, inside functions or for type checking:
    each module can be read (and changed) knowing only the modules below it."""
    graph = module_imports()
    cycles = []
    for start in sorted(graph):
        path, seen, todo = {start: None}, {start}, [start]
        while todo:  # breadth first: the shortest way back to ``start``
            module = todo.pop(0)
            for name in sorted(graph[module]):
                if name == start:
                    loop, step = [start], module
                    while step != start:
                        loop.append(step)
                        step = path[step]
                    cycles.append(" -> ".join([start, *reversed(loop[1:]), start]))
                    todo = []
                    break
                if name not in seen:
                    seen.add(name)
                    path[name] = module
                    todo.append(name)
    assert cycles == []


MAX_MODULE_LINES = 400
MAX_BODY_LINES = 60


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body: from its first statement after the docstring to its end (a
    signature of declared options, as a CLI command has, and a docstring are not counted)."""
    body = function.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1  # type: ignore[operator]


def test_every_module_and_function_is_short_enough_to_read_at_once():
    """No module of the package or the CLI over 400 lines, no function body over 60."""
    long = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "cli").rglob("*.py")]):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if text.count("\n") > MAX_MODULE_LINES:
            long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MAX_BODY_LINES:
                long.append(f"{name}:{node.lineno} {node.name}: a body of {body_lines(node)} lines")
    assert long == []


@pytest.mark.slow
def test_a_build_leaves_pandas_out(tmp_path):
    """Training images carry pandas; pyarrow imports it (0.35 s and more) for ``pa.array`` and
    ``to_numpy``, which the build path does not call (`batchplan.formats.arrow`)."""
    pytest.importorskip("pandas")  # the check means something only where pandas is installed
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"length": np.random.default_rng(0).integers(1, 900, 2_000)}), data)
    build = (
        "import batchplan; "
        f"batchplan.build_plan_file({str(data)!r}, {str(tmp_path / 'plan.arrow')!r}, "
        "batchplan.PlanConfig(max_tokens=1024, world_size=2, epochs=2, hidden_size=512))"
    )
    assert "pandas" not in loaded_after(build, watch=("pandas",))


@pytest.mark.slow
def test_replaying_a_plan_leaves_pandas_out(tmp_path):
    """The runtime reads plan columns over their buffers too: a training process that has
    pandas installed does not import it for the sampler or the LR schedule."""
    pytest.importorskip("pandas")
    pytest.importorskip("torch")
    import numpy as np

    from batchplan import PlanConfig
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    path = tmp_path / "plan.arrow"
    write_plan(build_plan(np.arange(1, 400, dtype=np.int32), PlanConfig(max_tokens=512, world_size=2, epochs=2)), path)
    replay = (
        "import torch; from batchplan.runtime import PlanSampler, token_lr_scheduler; "
        f"s = PlanSampler({str(path)!r}, rank=1, world_size=2); "
        "assert sum(1 for _ in s) > 0 and s.state_at_step(2)['position'] >= 0; "
        "token_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), s, warmup_tokens=10)"
    )
    assert "pandas" not in loaded_after(replay, watch=("pandas",))

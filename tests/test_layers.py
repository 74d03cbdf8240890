"""The package's layers: each imports only the ones below it, and no modules import each other in
a circle (function-local imports count too: they are arrows all the same, only later).

  runtime < ops < parallel < models < data < pipeline < planning < training < serve < commands

`commands` are the `python -m` entry points: the modules directly under jaxpipe/ and every
`__main__.py`. `kernels_pallas` and `kernels_cpu` sit beneath everything and import no jaxpipe
module; the schedule IR (jaxpipe/pipeline/ir) imports nothing of jaxpipe above the runtime's
JAX-free files.
"""

import ast
import pathlib

import pytest

from tests import helpers

LAYERS = (
    "runtime",
    "ops",
    "parallel",
    "models",
    "data",
    "pipeline",
    "planning",
    "training",
    "serve",
    "commands",
)
ROOT = pathlib.Path(helpers.ROOT)
PACKAGES = ("jaxpipe", "kernels_pallas", "kernels_cpu", "experiments", "configs")
# `Schedule`'s convenience methods (`.validate()`, `.simulate()`, `.to_png()`...) import the
# modules that implement them when called: the one circle kept, and kept function-local.
LOCAL_CIRCLE = {
    ("jaxpipe.pipeline.ir.schedule", "jaxpipe.pipeline.ir.validate"),
    ("jaxpipe.pipeline.ir.schedule", "jaxpipe.pipeline.ir.simulate"),
    ("jaxpipe.pipeline.ir.schedule", "jaxpipe.pipeline.ir.export"),
}


def _modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
  mods = {}
  for package in packages:
    for path in sorted((root / package).rglob("*.py")):
      parts = path.relative_to(root).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      mods[".".join(parts)] = path
  return mods


def imports_of(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
  """module -> the project modules it imports (anywhere in the file), by dotted name."""
  mods = _modules(root, packages)
  graph = {}
  for name, path in mods.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join(up + ([node.module] if node.module else []))
        for a in node.names:
          targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    graph[name] = {_owner(t, mods) for t in targets if t.split(".")[0] in packages} - {None}
  return graph


def _owner(target: str, mods: dict) -> str | None:
  while target and target not in mods:
    target = target.rpartition(".")[0]
  return target or None


def layer(module: str) -> int | None:
  """The layer index of a jaxpipe module; None for jaxpipe's face and for other packages."""
  parts = module.split(".")
  if parts[0] != "jaxpipe" or len(parts) == 1:
    return None
  if parts[-1] == "__main__" or len(parts) == 2 and parts[1] not in LAYERS:
    return LAYERS.index("commands")
  return LAYERS.index(parts[1])


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
  bad = []
  for a, targets in sorted(graph.items()):
    for b in sorted(targets):
      if b.startswith("jaxpipe") and a.startswith(("kernels_pallas", "kernels_cpu")):
        bad.append(f"{a} -> {b} ({a.split('.')[0]} imports no jaxpipe module)")
      la, lb = layer(a), layer(b)
      if la is not None and lb is not None and lb > la:
        bad.append(f"{a} ({LAYERS[la]}) -> {b} ({LAYERS[lb]})")
  return bad


def circles(graph: dict[str, set[str]], allowed=frozenset()) -> list[list[str]]:
  """Every strongly connected set of two or more modules (Tarjan), edges in `allowed` left out."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if (v, w) in allowed or w == v:
        continue
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      part = []
      while True:
        w = stack.pop()
        on.discard(w)
        part.append(w)
        if w == v:
          break
      if len(part) > 1:
        out.append(sorted(part))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


@pytest.fixture(scope="module")
def graph():
  return imports_of()


def test_every_module_sits_in_a_layer(graph):
  stray = [m for m in graph if m.startswith("jaxpipe.") and layer(m) is None]
  assert not stray, stray
  packages = {p.name for p in (ROOT / "jaxpipe").iterdir() if (p / "__init__.py").exists()}
  assert packages == set(LAYERS) - {"commands"}, packages


def test_no_arrow_runs_back_up(graph):
  assert upward_arrows(graph) == []


def test_no_circle(graph):
  assert circles(graph, LOCAL_CIRCLE) == []


def test_the_kept_circle_stays_function_local():
  path = ROOT / "jaxpipe/pipeline/ir/schedule.py"
  top = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ImportFrom)]
  local = {f"jaxpipe.pipeline.ir.{n.module.rpartition('.')[2]}" for n in top if n.module}
  assert not local & {b for _, b in LOCAL_CIRCLE}, local


def test_the_schedule_ir_imports_nothing_above_the_runtime(graph):
  ir = [m for m in graph if m.startswith("jaxpipe.pipeline.ir")]
  assert len(ir) > 10
  for m in ir:
    outside = {t for t in graph[m] if not t.startswith("jaxpipe.pipeline.ir")}
    assert outside <= {"jaxpipe.runtime.files"}, (m, outside)


def test_no_test_module_imports_another():
  graph = imports_of(ROOT, ("tests",))
  bad = {
      m: sorted(t for t in ts if t.rpartition(".")[2].startswith("test_"))
      for m, ts in graph.items()
  }
  assert {m: ts for m, ts in bad.items() if ts} == {}


# The checks themselves, on a small tree written here: each must see what it is for.


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
  for rel, text in files.items():
    p = tmp_path / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
  for d in {p.parent for p in tmp_path.rglob("*.py")}:
    (d / "__init__.py").touch()
  return tmp_path


def test_the_checks_see_an_upward_arrow_and_a_circle(tmp_path):
  root = _tree(
      tmp_path,
      {
          "jaxpipe/ops/fp8.py": "from jaxpipe.models import moe\n",  # ops -> models: up
          "jaxpipe/models/moe.py": "def f():\n  from jaxpipe.models.router import r\n",
          "jaxpipe/models/router.py": "from jaxpipe.models import moe\nr = 1\n",
          "jaxpipe/serve/engine.py": "from ..training import trainer\n",  # relative, down: fine
          "jaxpipe/training/trainer.py": "",
          "jaxpipe/train.py": "from jaxpipe.serve import engine\n",
          "kernels_pallas/k.py": "import jaxpipe.ops.fp8\n",
      },
  )
  graph = imports_of(root, ("jaxpipe", "kernels_pallas"))
  assert graph["jaxpipe.serve.engine"] == {"jaxpipe.training.trainer"}
  assert upward_arrows(graph) == [
      "jaxpipe.ops.fp8 (ops) -> jaxpipe.models.moe (models)",
      "kernels_pallas.k -> jaxpipe.ops.fp8 (kernels_pallas imports no jaxpipe module)",
  ]
  assert circles(graph) == [["jaxpipe.models.moe", "jaxpipe.models.router"]]
  assert circles(graph, {("jaxpipe.models.moe", "jaxpipe.models.router")}) == []
  assert layer("jaxpipe.train") == LAYERS.index("commands")
  assert layer("jaxpipe.serve.__main__") == LAYERS.index("commands")

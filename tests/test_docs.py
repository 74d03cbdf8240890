"""README.md and docs/: the README stays short, every `python -m` module and every repository
path in code font they name exists, and every relative link in the README reaches a file (and,
with an #anchor, a heading of that page).

Pure text and importlib: no subprocess, no JAX. `mkdocs build --strict` checks the site's own
links; this keeps the README's, which the site does not build, honest.
"""

import ast
import importlib.machinery
import importlib.util
import pathlib
import re
import sys
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_MODULE = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*\w)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_PATH = re.compile(
    r"`((?:jaxpipe|kernels_pallas|kernels_cpu|configs|experiments|tests|notebooks|docs)/[^`\s]*)`"
)
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _without_fences(text: str) -> str:
  return _FENCE.sub("", text)


def _heading_text(raw: str) -> str:
  """A heading as rendered: code spans, emphasis and links reduced to their text."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
  return re.sub(r"[`*]", "", text).strip()


def _mkdocs_slug(text: str) -> str:
  """Python-Markdown's toc.slugify, the anchors of the documentation site."""
  text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
  text = re.sub(r"[^\w\s-]", "", text).strip().lower()
  return re.sub(r"[-\s]+", "-", text)


def _github_slug(text: str) -> str:
  """GitHub's anchors for the same heading, where the README's links are followed."""
  text = re.sub(r"[^\w\- ]", "", text.strip().lower())
  return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
  """Anchors that resolve both on the site and on GitHub."""
  headings = [_heading_text(h) for h in _HEADING.findall(_without_fences(page.read_text()))]
  return {_mkdocs_slug(h) for h in headings} & {_github_slug(h) for h in headings}


def test_readme_is_short():
  lines = README.read_text().count("\n")
  assert (
      lines <= MAX_README_LINES
  ), f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail into docs/"


MAX_RESULT_CELL = 100  # characters a README results cell shows; the detail is on the page it links


def test_readme_results_cells_are_short():
  """Each cell of the README's results tables shows one figure: at most MAX_RESULT_CELL
  characters as rendered (a link counts as its text)."""
  text = README.read_text()
  results = text[text.index("\n## Results") : text.index("\n## ", text.index("\n## Results") + 1)]
  rows = [line for line in results.splitlines() if line.startswith("| ") and "---" not in line]
  assert len(rows) > 10, rows
  long = []
  for row in rows:
    for cell in row.strip("|").split(" | "):
      shown = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", cell.strip())
      if len(shown) > MAX_RESULT_CELL:
        long.append(f"{len(shown)}: {shown}")
  assert not long, "README results cells over the limit (move the detail to the linked page):\n" + (
      "\n".join(long)
  )


def _modules() -> list[tuple[str, str]]:
  found = []
  for path in [README, *PAGES]:
    for name in _MODULE.findall(path.read_text()):
      found.append((path.relative_to(ROOT).as_posix(), name))
  return found


def test_docs_name_commands():
  names = {name for _, name in _modules()}
  assert {"jaxpipe.train", "jaxpipe.schedule", "jaxpipe.serve"} <= names


@pytest.mark.parametrize("where,module", sorted(set(_modules())))
def test_python_m_module_exists(where, module):
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  try:
    # a top-level name straight from sys.path: through the meta path, `pip` meets setuptools'
    # distutils shim, which warns whenever some earlier test imported distutils
    find = importlib.util.find_spec if "." in module else importlib.machinery.PathFinder.find_spec
    spec = find(module)
  except ModuleNotFoundError:
    spec = None
  assert spec is not None, f"{where} names `python -m {module}`, which this checkout does not have"


def _readme_links() -> list[str]:
  return _LINK.findall(_without_fences(README.read_text()))


def test_readme_links_resolve():
  bad = []
  for target in _readme_links():
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    page = (ROOT / path).resolve() if path else README
    if not page.exists():
      bad.append(f"{target}: no file {path}")
      continue
    if anchor:
      if page.suffix != ".md":
        bad.append(f"{target}: an anchor into {path}, which has no headings")
      elif anchor not in _anchors(page):
        bad.append(f"{target}: no heading of {page.relative_to(ROOT)} has the anchor #{anchor}")
  assert not bad, "README.md links that do not resolve:\n" + "\n".join(bad)


def test_readme_links_into_docs():
  assert any(t.startswith("docs/benchmarks.md#") for t in _readme_links())


def test_paths_in_code_font_exist():
  """`jaxpipe/serve/pages.py`, `tests/serve/`, `tests/x.py::test_y`: files, folders and tests the
  prose names (placeholders such as `checkpoints/<step>/` or `jaxpipe/{train,launch}.py` aside)."""
  missing = []
  for path in [README, *PAGES]:
    for name in _PATH.findall(path.read_text()):
      if any(c in name for c in "<{*"):
        continue
      file, _, test = name.partition("::")  # a test's node id names its file and its function
      if not (ROOT / file).exists():
        missing.append(f"{path.relative_to(ROOT)}: {name}")
      elif test and not re.search(rf"^def {re.escape(test)}\(", (ROOT / file).read_text(), re.M):
        missing.append(f"{path.relative_to(ROOT)}: {name} (no such test in {file})")
  assert not missing, "paths named in the docs that this checkout does not have:\n" + "\n".join(
      missing
  )


# --- every flag a documented command passes is one its runner defines ---------------------------

_COMMAND = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*\w)((?:[^\n`|;&#)]|\\\n)*)")
_ABSL = {
    "help",
    "helpfull",
    "helpshort",
    "helpxml",
    "verbosity",
    "v",
    "flagfile",
    "logtostderr",
    "alsologtostderr",
    "log_dir",
    "only_check_args",
}


def _commands() -> list[tuple[str, str, list[str]]]:
  """(page, module, the flag names its command passes), for every `python -m` in the docs."""
  found = []
  for path in [README, *PAGES]:
    for module, rest in _COMMAND.findall(path.read_text()):
      rest = rest.replace("\\\n", " ").split(" -- ")[0]  # launch: the rank's command follows
      names = [t[2:].split("=")[0] for t in rest.split() if t.startswith("--") and len(t) > 2]
      if module.split(".")[0] in ("jaxpipe", "experiments") and "." in module:  # ours, named
        found.append((path.relative_to(ROOT).as_posix(), module, names))
  return found


def _runner_flags(module: str) -> set[str]:
  import absl.flags

  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  package = importlib.util.find_spec(module).submodule_search_locations
  name = f"{module}.__main__" if package else module  # python -m jaxpipe.serve
  runner = importlib.import_module(name)
  flag_values = getattr(runner, "FLAGS", None)
  assert isinstance(
      flag_values, absl.flags.FlagValues
  ), f"{name} has no module-level FLAGS: define its flags on cli.flag_values(__name__)"
  return set(flag_values)


def test_documented_flags_are_the_runners_flags():
  bad = []
  flags_of: dict[str, set[str]] = {}
  for where, module, names in _commands():
    if module not in flags_of:
      flags_of[module] = _runner_flags(module)
    known = flags_of[module] | _ABSL
    for name in names:
      base = name.split(".")[0]  # --config.model.n_layers=8 overrides a field of --config
      if base not in known and not (base.startswith("no") and base[2:] in known):
        bad.append(f"{where}: python -m {module} --{name}: no such flag")
  assert len(flags_of) >= 10, sorted(flags_of)
  assert not bad, "\n".join(bad)


def _public_functions() -> list[tuple[str, ast.FunctionDef]]:
  """(where, node) of every public function and public method of a public class in jaxpipe/."""
  found = []
  for path in sorted((ROOT / "jaxpipe").rglob("*.py")):
    tree = ast.parse(path.read_text())
    nodes = [(n.name, n) for n in tree.body if hasattr(n, "name")]
    for c in tree.body:
      if isinstance(c, ast.ClassDef) and not c.name.startswith("_"):
        nodes += [(f"{c.name}.{m.name}", m) for m in c.body if hasattr(m, "name")]
    for name, node in nodes:
      is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
      if is_function and not node.name.startswith("_"):
        found.append((f"{path.relative_to(ROOT)}::{name}", node))
  return found


def _parameters(node: ast.FunctionDef) -> list[str]:
  a = node.args
  names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
  names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
  return [n for n in names if n not in ("self", "cls")]


def test_public_functions_document_their_arguments():
  """Public functions take their parameters' meaning from an `Args:` section naming each one
  (Google style, as JAX and Flax write them)."""
  bad = []
  for where, node in _public_functions():
    params = _parameters(node)
    if not params:
      continue
    doc = ast.get_docstring(node) or ""
    args = doc.partition("Args:")[2] if "Args:" in doc else None
    if args is None:
      bad.append(f"{where}: no Args section")
      continue
    missing = [p for p in params if not re.search(rf"(^|\W){re.escape(p)}\b", args)]
    if missing:
      bad.append(f"{where}: Args leaves out {missing}")
  assert not bad, f"{len(bad)} public functions:\n" + "\n".join(bad[:40])

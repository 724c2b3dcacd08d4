"""The house's written rules hold in the code: every NOTE reference names one NOTE, every
path docs/architecture.md gives exists, every link of the docs reaches its file and
heading, every public name is in docs/api.md, imports go the one way that doc states
with no cycle, and no library file is over 500 lines."""
import ast
import os
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "actsave"
SEARCHED = ("actsave", "triton_kernels", "bench", "tests", "docs", "examples", "README.md")

# A NOTE is defined by a line holding it alone, ``NOTE [ Name ]`` (after a ``#`` in
# code), its text below; anything else that names it refers to it. A reference may
# wrap across comment lines. ``...`` stands for any name in prose about NOTEs.
_DEFINITION = re.compile(r"^[ \t]*(?:#[ \t]*)?NOTE \[ (\S[^\]]*\S) \][ \t]*$", re.M)
_REFERENCE = re.compile(r"NOTE\s+\[([^\]]+)\]")
_PLACEHOLDERS = {"..."}


def _searched_files() -> list:
    files = []
    for name in SEARCHED:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md"))
    return [f for f in files if f != Path(__file__).resolve()]  # this file's NOTEs are fixtures


def note_name(text: str) -> str:
    """A NOTE's name as written between its brackets, a wrap's comment markers and
    spaces folded."""
    return " ".join(text.replace("#", " ").split())


def notes(files) -> tuple:
    """``(definitions, references, misspelled)``: each name -> the places (file:line)
    naming it; misspelled: the places of references whose brackets do not hold the name
    between spaces (``NOTE [Name]``)."""
    definitions, references, misspelled = {}, {}, []
    for path in files:
        text = path.read_text()
        where = lambda m: f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"  # noqa: E731
        for m in _DEFINITION.finditer(text):
            definitions.setdefault(m.group(1), []).append(where(m))
        for m in _REFERENCE.finditer(text):
            references.setdefault(note_name(m.group(1)), []).append(where(m))
            if not (m.group(1)[0].isspace() and m.group(1)[-1].isspace()):
                misspelled.append(where(m))
    return definitions, references, misspelled


def note_problems(files) -> list:
    """What is wrong with the NOTEs of ``files``: a name defined twice, a reference
    that names no definition, a name written other than ``NOTE [ Name ]``."""
    definitions, references, misspelled = notes(files)
    problems = [f"NOTE [ {name} ] is defined {len(places)} times: {places}"
                for name, places in definitions.items() if len(places) > 1]
    problems += [f"NOTE [ {name} ] is referred to at {places} but defined nowhere"
                 for name, places in references.items() if name not in definitions and name not in _PLACEHOLDERS]
    problems += [f"NOTE [ {name} ] at {places}: a name starts with a capital letter"
                 for name, places in definitions.items() if not name[0].isupper() and not name[0].isdigit()
                 and not name.startswith("torch")]
    problems += [f"a NOTE reference at {place} is not written NOTE [ Name ], with a space inside each bracket"
                 for place in misspelled]
    return problems


def test_every_note_reference_names_one_definition():
    assert note_problems(_searched_files()) == []


def test_the_note_check_finds_a_dangling_reference_and_a_second_definition(tmp_path):
    code = tmp_path / "code.py"
    code.write_text("# NOTE [ Rule ]\n# The rule.\n\nx = 1  # NOTE [ Rule ] holds; NOTE [ Gone ] does not\n")
    other = tmp_path / "other.py"
    other.write_text("# NOTE [ Rule ]\n# Again.\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = note_problems([code, other])
    finally:
        ROOT = saved
    assert any("NOTE [ Rule ] is defined 2 times" in p for p in problems)
    assert any("NOTE [ Gone ] is referred to at ['code.py:4'] but defined nowhere" in p for p in problems)


def test_the_note_check_finds_a_reference_in_the_other_spelling(tmp_path):
    code = tmp_path / "code.py"
    code.write_text("# NOTE [ Rule ]\n# The rule.\n\nx = 1  # as NOTE [Rule] says\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = note_problems([code])
    finally:
        ROOT = saved
    assert problems == ["a NOTE reference at code.py:4 is not written NOTE [ Name ], with a space inside each bracket"]


# ----------------------------------------------------------------- docs/architecture.md

_TREE_ENTRY = re.compile(r"^( *)([\w.]+/?(?:, [\w.]+)*)(?:\s{2,}|$)")
_QUOTED_PATH = re.compile(r"`([\w./]+(?:\.py|\.md|/))`")


def tree_paths(doc: str) -> list:
    """The paths of the layout tree (the first fenced block): each entry under the
    last directory above it at a smaller indent; ``a.py, b.py`` names two."""
    block = doc.split("```")[1]
    paths, parents = [], []  # parents: (indent, directory path)
    for line in block.splitlines():
        m = _TREE_ENTRY.match(line)
        if not m or not line.strip():
            continue
        indent = len(m.group(1))
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        for name in m.group(2).split(", "):
            paths.append(base + name)
            if name.endswith("/"):
                parents.append((indent, base + name))
    return paths


def quoted_paths(doc: str) -> list:
    """Paths quoted in the doc's prose and tables (```runtime/function.py```), relative
    to the package or to the repository."""
    return _QUOTED_PATH.findall(doc.split("```", 2)[2])


def repository_paths() -> set:
    """Every file and folder (with a trailing ``/``) under the root, relative to it,
    hidden folders (.git, virtual environments) left out."""
    found = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"]
        here = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if here == "." else here + "/"
        found.update(prefix + d + "/" for d in subfolders)
        found.update(prefix + f for f in files)
    return found


def missing_paths(doc: str) -> list:
    """The tree's paths that do not exist, and the quoted ones that name no file or
    folder of the repository (from its root, the package's, or as a path's last part:
    ``_rounding.py``)."""
    every = repository_paths()

    def known(path):
        return path in every or f"actsave/{path}" in every or any(p.endswith("/" + path) for p in every)
    return [p for p in tree_paths(doc) if p not in every] + [p for p in quoted_paths(doc) if not known(p)]


def test_every_path_in_the_architecture_doc_exists():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert len(tree_paths(doc)) > 50  # the tree was read
    assert missing_paths(doc) == []


def test_the_path_check_finds_a_renamed_file():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    renamed = doc.replace("    nested.py ", "    nesting.py", 1).replace("`runtime/function.py`", "`runtime/functions.py`")
    assert missing_paths(renamed) == ["actsave/runtime/nesting.py"] + ["runtime/functions.py"] * doc.count("`runtime/function.py`")


# ----------------------------------------------------------------- links of the docs

# A Markdown link, ``[text](target)``, outside code (fenced blocks and inline spans).
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.M | re.S)
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*$", re.M)
LINKED_DOCS = ("README.md", "docs", "examples", "bench")


def heading_anchors(text: str) -> set:
    """The anchors GitHub gives the headings of a Markdown text: lower case, every
    character but letters, digits, ``-``, ``_`` and spaces dropped, spaces as ``-``; a
    repeated one numbered ``-1``, ``-2``, ..."""
    seen, anchors = {}, set()
    for m in _HEADING.finditer(_CODE.sub("", text)):
        anchor = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def broken_links(path: Path, text: str) -> list:
    """The links of ``text`` (the Markdown file at ``path``) to a file that does not
    exist or to a heading its Markdown file does not have; links to other sites are
    not followed."""
    broken = []
    for m in _LINK.finditer(_CODE.sub("", text)):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        destination = (path.parent / file).resolve() if file else path
        if not destination.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in heading_anchors(destination.read_text()):
            broken.append(f"{path.relative_to(ROOT)}: {target}: no such heading")
    return broken


def test_every_link_of_the_docs_reaches_its_file_and_heading():
    files = [ROOT / name if (ROOT / name).is_file() else None for name in LINKED_DOCS]
    files = [f for f in files if f] + [p for name in LINKED_DOCS if (ROOT / name).is_dir()
                                       for p in sorted((ROOT / name).rglob("*.md"))]
    assert len(files) > 5 and sum(len(_LINK.findall(f.read_text())) for f in files) > 100  # the links were read
    assert [problem for f in files for problem in broken_links(f, f.read_text())] == []


def test_the_link_check_finds_a_renamed_heading_and_file():
    readme = ROOT / "README.md"
    text = readme.read_text() + "\n[a](docs/limits.md#no-such-heading) [b](docs/no_such_file.md) `[c](d.md)`\n"
    assert broken_links(readme, text) == ["README.md: docs/limits.md#no-such-heading: no such heading",
                                          "README.md: docs/no_such_file.md: no such file"]
    assert {"memory-no-tensor-holds-on-a-cpu-2026-11-29", "the-frontier-at-the-nineteenth-sessions-tree-cpu-2026-12-01"} \
        <= heading_anchors((ROOT / "docs" / "results.md").read_text())


def undocumented(names, doc: str) -> list:
    """The public names that ``doc`` never quotes (as ``name`` or ``name(...)``)."""
    return [name for name in names if not re.search(r"`" + re.escape(name) + r"[`(.\[]", doc)]


def test_every_public_name_is_in_the_api_doc():
    import actsave
    import actsave.offload
    doc = (ROOT / "docs" / "api.md").read_text()
    assert undocumented([*actsave.__all__, *actsave.offload.__all__], doc) == []


def test_the_api_doc_check_finds_a_name_left_out():
    doc = (ROOT / "docs" / "api.md").read_text()
    assert undocumented(["MemoryEstimate", "Profile"], doc.replace("`MemoryEstimate`", "an estimate")) == [
        "MemoryEstimate"]


# ----------------------------------------------------------------- imports go one way

# docs/architecture.md: "triton_kernels imports nothing from actsave; runtime imports
# nothing from planning; codecs imports nothing from runtime or planning."
FORBIDDEN = {
    "triton_kernels": ("actsave",),
    "actsave.runtime": ("actsave.planning",),
    "actsave.codecs": ("actsave.runtime", "actsave.planning"),
}


def module_name(path: Path) -> str:
    """The dotted name a file of the package (or of triton_kernels/) imports as."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set:
    """The modules a file imports, relative imports resolved (triton_kernels/ as the
    package it is installed as, actsave.triton_kernels, counts as triton_kernels)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def import_violations(files) -> list:
    problems = []
    for path in files:
        name = module_name(path)
        for owner, banned in FORBIDDEN.items():
            if name == owner or name.startswith(owner + "."):
                problems += [f"{name} imports {target}" for target in sorted(imported(path))
                             if any(target == b or target.startswith(b + ".") for b in banned)]
    return problems


@pytest.mark.parametrize("owner", sorted(FORBIDDEN))
def test_imports_go_one_way(owner):
    files = sorted((ROOT / owner.replace(".", "/")).rglob("*.py"))
    assert files
    assert import_violations(files) == []


def test_the_import_check_finds_a_runtime_module_that_imports_planning(tmp_path):
    fake = ROOT / "actsave" / "runtime" / "_house_rules_probe.py"
    fake.write_text("from ..planning import plans\n")
    try:
        assert import_violations([fake]) == ["actsave.runtime._house_rules_probe imports actsave.planning",
                                             "actsave.runtime._house_rules_probe imports actsave.planning.plans"]
    finally:
        fake.unlink()


def top_level_imports(path: Path, modules: set) -> set:
    """The modules of ``modules`` that a file imports as it loads: its module-level
    imports (an import inside a function or under TYPE_CHECKING runs later, or never)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + [n for h in getattr(node, "handlers", []) for n in h.body])
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)

    visit(ast.parse(path.read_text()).body)
    return {target for target in found if target in modules and target != name}


def import_cycles(files) -> list:
    """The cycles (as sorted module lists) among the modules of ``files`` imported as
    they load: strongly connected components of more than one module."""
    by_name = {module_name(path): path for path in files}
    graph = {name: top_level_imports(path, set(by_name)) for name, path in by_name.items()}
    order, low, stack, cycles = {}, {}, [], []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in order:
            visit(name)
    return cycles


def package_files() -> list:
    return sorted(path for path in (ROOT / "actsave").rglob("*.py") if "triton_kernels" not in path.parts)


def test_no_module_of_the_package_imports_itself_back_as_it_loads():
    assert import_cycles(package_files()) == []


def test_the_cycle_check_finds_two_modules_that_import_each_other():
    probes = [ROOT / "actsave" / "runtime" / f"_house_rules_cycle_{i}.py" for i in (0, 1)]
    probes[0].write_text("from . import _house_rules_cycle_1\n")
    probes[1].write_text("from ._house_rules_cycle_0 import x\n\n\ndef later():\n    from .. import sequential\n")
    try:
        assert import_cycles(package_files()) == [["actsave.runtime._house_rules_cycle_0",
                                                   "actsave.runtime._house_rules_cycle_1"]]
    finally:
        for probe in probes:
            probe.unlink()


# ----------------------------------------------------------------- the chain class


# Hooks torch calls on every module it handles so (TorchScript's, before compiling one):
# an answer to torch's protocol, not a job of the class.
_TORCH_PROTOCOL = frozenset({"__prepare_scriptable__"})


def methods_of(cls) -> list:
    """The names ``cls`` defines in actsave's classes of its MRO: functions, properties
    and class or static methods (not what torch's nn.Sequential defines, nor torch's
    protocol hooks)."""
    kinds = (types.FunctionType, property, classmethod, staticmethod)
    return sorted({name for klass in cls.__mro__ if klass.__module__.startswith("actsave")
                   for name, value in vars(klass).items() if isinstance(value, kinds) and name not in _TORCH_PROTOCOL})


def test_checkpointed_sequential_is_the_container_and_its_forward():
    # Its other jobs live beside it: per-layer settings (layer_settings.py), where
    # segments come from (planning/chain_segments.py), the forward's modes
    # (runtime/chain.py, runtime/compiled_chain.py), describe()'s columns.
    from actsave import CheckpointedSequential
    assert len(methods_of(CheckpointedSequential)) <= 15, methods_of(CheckpointedSequential)


# ----------------------------------------------------------------- file sizes

# A library file past this many lines holds more than one concept: split it by concept
# (the way planning/pareto.py left solver.py), not by squeezing its comments.
MAX_LIBRARY_LINES = 500


def long_files(files, root: Path = ROOT) -> list:
    """``[(path under root, lines)]`` of the files over MAX_LIBRARY_LINES."""
    sized = ((path, len(path.read_text().splitlines())) for path in files)
    return [(str(path.relative_to(root)), n) for path, n in sized if n > MAX_LIBRARY_LINES]


def test_no_library_file_is_over_the_line_limit():
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "triton_kernels").rglob("*.py"))
    assert len(files) > 50
    assert long_files(files) == []


def test_the_size_check_finds_a_long_file(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_LIBRARY_LINES + 1))
    short = tmp_path / "short.py"
    short.write_text("x = 1\n" * MAX_LIBRARY_LINES)
    assert long_files([long, short], root=tmp_path) == [("long.py", MAX_LIBRARY_LINES + 1)]

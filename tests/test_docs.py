"""The docs name only what exists: every path, link, module, public name, command and option.

The reference pages (README.md, BENCHMARKS.md, ARCHITECTURE.md, docs/*.md) are read as
Markdown; what they name is checked against the checkout:

* links ``[text](target)``: the file exists (relative to the page) and, for an anchor into
  a Markdown page, a heading of that page has that GitHub slug;
* paths in code spans (``examples/x.py``, ``docs/x.md``, a top-level entry such as
  ``compat/env.sh``): the file or folder exists;
* ``rrfp_async.x.y`` and ``rr.X.y``: the module imports and the attribute is there;
* commands (``rrfp-async ...``, ``python examples/...``, ``python scripts/...``, ``torchrun
  ... examples/...``, ``./dev ...``): the subcommand exists, its ``--help`` runs, and every
  option the command line uses is one the command takes.

History is not reference: the dated reports under docs/reports/ and CHANGELOG.md name files
and options of their day, and are not checked.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from rrfp_async.errors import ExtraMissingError

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        ROOT / "ARCHITECTURE.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)

# Pages that other branches add (the docs link to them already). Each entry is removed when
# its branch is merged; the test fails if a listed page exists, so the list cannot go stale.
PENDING: dict[str, str] = {}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
# (Not in double quotes: ``"rrfp_async.commands"`` is an entry-point group, not a module.)
_MODULE = re.compile(r"(?<![\w.\"])(?:rrfp_async|rrfp_lab)(?:\.[A-Za-z_]\w*)+")
_RR_NAME = re.compile(r"(?<![\w.])rr\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_PATH_EXT = (".py", ".md", ".toml", ".sh", ".txt", ".png", ".json", ".cfg")
# The repository's own top-level entries (not what a run left beside them: out/, caches).
# Packages of the peers whose source files the docs cite (not files of this repository).
_PEERS = {"deepspeed", "megatron", "torch", "torchtitan", "transformers"}
_IGNORED_TOP = {"out", "build", "dist", "__pycache__"}
_TOP = {
    p.name
    for p in ROOT.iterdir()
    if not p.name.startswith(".")
    and p.name not in _IGNORED_TOP
    and not p.name.endswith(".egg-info")
}


@dataclass(frozen=True)
class Page:
    path: Path
    text: str  # the whole page
    prose: str  # the page without its fenced code blocks
    blocks: tuple[str, ...]  # the fenced code blocks' contents

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


def _page(path: Path) -> Page:
    text = path.read_text(encoding="utf-8")
    return Page(path, text, _FENCE.sub("", text), tuple(_FENCE.findall(text)))


def _pages() -> list[Page]:
    return [_page(p) for p in PAGES]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Page) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in page.prose.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = _slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _pending_or_exists(rel: str) -> bool:
    """Whether the repo path ``rel`` exists, or is a page another branch adds."""
    return (ROOT / rel).exists() or rel.rstrip("/") in PENDING


def test_pending_pages_are_still_pending() -> None:
    """A page listed as pending that now exists must leave the list (so its links, anchors
    included, are checked)."""
    arrived = [p for p in PENDING if (ROOT / p).exists()]
    assert not arrived, f"these pages exist now; remove them from PENDING: {arrived}"


def test_slug_follows_github() -> None:
    assert _slug("Paper scale, simulated — `rrfp-async bench paper`") == (
        "paper-scale-simulated--rrfp-async-bench-paper"
    )
    assert _slug("Against torch.distributed.pipelining — x") == (
        "against-torchdistributedpipelining--x"
    )
    assert _slug('"BF" and "BFW"') == "bf-and-bfw"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    pg = _page(page)
    bad = []
    for target in _LINK.findall(pg.prose):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        rel = os.path.relpath(dest, ROOT)
        if not dest.exists():
            if rel not in PENDING:
                bad.append(f"{target}: no such file ({rel})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(_page(dest)):
            bad.append(f"{target}: no heading with anchor #{anchor} in {rel}")
    assert not bad, f"{pg.name}: " + "; ".join(bad)


def _path_candidates(page: Page) -> list[str]:
    """Code spans of the page (outside fenced blocks) that name a repo path."""
    out = []
    for span in _SPAN.findall(page.prose):
        s = span.strip()
        if not re.fullmatch(r"\.?[\w./-]+", s) or s.startswith(("..", "/")) or "//" in s:
            continue
        first = s.split("/", 1)[0]
        if first in _PEERS:
            continue  # a file of a peer's package (megatron/training/training.py)
        if ("/" in s and first in _TOP) or (s in _TOP) or s.endswith((".py", ".md")):
            out.append(s)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_exist(page: Path) -> None:
    pg = _page(page)
    bad = []
    for s in _path_candidates(pg):
        # A bare module file (``_admission.py`` in ARCHITECTURE.md's layer table) is the
        # package's; anything else is relative to the repo root or to the page.
        where = [ROOT / s, page.parent / s, ROOT / "rrfp_async" / s]
        if not any(w.exists() for w in where) and not _pending_or_exists(s):
            bad.append(s)
    assert not bad, f"{pg.name} names paths that do not exist: {sorted(set(bad))}"


def test_path_candidates_are_found() -> None:
    """The path check is not vacuous: it sees spans that name paths, and only those."""
    pg = Page(
        ROOT / "x.md",
        "",
        "`examples/custom_policy.py` `docs/x.md` `compat/env.sh` `out/demo/` `step.json`"
        " `rr.Task` `--json`",
        (),
    )
    assert _path_candidates(pg) == ["examples/custom_policy.py", "docs/x.md", "compat/env.sh"]


def _has_attr(obj: object, name: str) -> bool:
    """``getattr`` or a declared field (a dataclass field, an annotated or slotted one)."""
    if hasattr(obj, name):
        return True
    return any(
        name in getattr(obj, attr, ())
        for attr in ("__dataclass_fields__", "__annotations__", "__slots__")
    )


def _resolve_source(parts: list[str]) -> str | None:
    """For a name whose import needs a peer that is not installed (``rrfp_async.torchtitan.
    readiness_first``): None when the longest prefix that is a module file of the package
    exists and its ``__all__`` names the next part (if any), else why not. Nothing is
    imported."""
    for j in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:j])
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if path.is_file():
            break
    else:
        return "no such module"
    module, attrs = ".".join(parts[:j]), parts[j:]
    if not attrs:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names |= {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    return None if attrs[0] in names else f"{module} has no attribute {attrs[0]!r} in __all__"


def _resolve(dotted: str) -> str | None:
    """None when ``dotted`` (``rrfp_async.x.y``) names a module or an attribute of one, else
    why not."""
    parts = dotted.split(".")
    obj: Any = None
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = importlib.import_module(name)
        except ExtraMissingError:
            # A face for a peer not installed here (rrfp_async.torchtitan): its source is
            # looked at instead of its import.
            return _resolve_source(parts)
        except ModuleNotFoundError as e:
            if e.name is not None and not name.startswith(e.name):
                return f"importing {name} failed: {e}"  # a dependency is missing
            continue
        for attr in parts[i:]:
            if not _has_attr(obj, attr):
                return f"{name} has no attribute {attr!r}"
            obj = getattr(obj, attr, None)
        return None
    return "no such module"


@pytest.mark.timeout(300)
def test_modules_and_public_names_exist() -> None:
    """Every ``rrfp_async.…`` and ``rr.…`` the pages name imports (modules are imported,
    nothing is run)."""
    names: dict[str, set[str]] = {}
    for pg in _pages():
        for m in _MODULE.findall(pg.text):
            names.setdefault(m, set()).add(pg.name)
        for m in _RR_NAME.findall(pg.text):
            names.setdefault(f"rrfp_async.{m}", set()).add(pg.name)
    assert "rrfp_async.simulate" in names and "rrfp_async.pipelining" in names  # not vacuous
    bad = {n: (why, sorted(names[n])) for n in sorted(names) if (why := _resolve(n))}
    assert not bad, f"named in the docs but missing: {bad}"


def test_resolve_refuses_what_is_not_there() -> None:
    assert _resolve("rrfp_async.simulate") is None
    assert _resolve("rrfp_async.Task.parse") is None
    assert _resolve("rrfp_async.channels.P2PChannel") is None
    assert _resolve("rrfp_async.no_such_name") is not None
    assert _resolve("rrfp_async.Task.no_such_method") is not None
    assert _resolve("rrfp_async.no_such_module.x") is not None
    if importlib.util.find_spec("torchtitan") is None:  # read from the source, not imported
        assert _resolve("rrfp_async.torchtitan.readiness_first") is None
        assert _resolve("rrfp_async.torchtitan.no_such_name") is not None


# ---- commands ---------------------------------------------------------------------------

_STARTS = ("rrfp-async ", "python examples/", "python scripts/", "torchrun ", "./dev ")
_STOP = {"|", "||", "&&", ";", ">", ">>", "2>", "&"}


def _command_lines(page: Page) -> list[str]:
    """Command lines of the page: lines of fenced blocks (backslash continuations joined,
    comments dropped) and code spans, that start with a command the project provides."""
    lines = []
    for block in page.blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += joined.splitlines()
    lines += _SPAN.findall(page.prose)
    out = []
    for line in lines:
        s = re.sub(r"^(?:\$ )?(?:[A-Z_]+=\S+ )+", "", line.strip())  # COLUMNS=80 cmd
        if s.startswith(_STARTS):
            out.append(s)
    return out


def _tokens(line: str) -> list[str]:
    """The command's words up to a pipe, a redirection or a comment; ``[--opt x]`` is
    optional syntax, read as ``--opt x``."""
    try:
        words = shlex.split(line.replace("[", " ").replace("]", " "), comments=True)
    except ValueError:  # an unbalanced quote in a span that shows part of a command
        words = line.split()
    out = []
    for w in words:
        if w in _STOP:
            break
        out.append(w)
    return out


def _options(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and w not in ("-", "--")]


def _cli_main() -> click.Group:
    from rrfp_async.cli import main

    return main


def _check_rrfp_async(words: list[str]) -> str | None:
    """Walk the click tree along ``words`` (after ``rrfp-async``); None if the command
    exists, its --help runs and it takes every option used."""
    cmd: click.Command = _cli_main()
    path: list[str] = []
    rest = list(words)
    while isinstance(cmd, click.Group):
        while rest and rest[0].startswith("-"):  # group options (--log-format json)
            opt = rest.pop(0).split("=", 1)[0]
            if opt not in _opts_of(cmd):
                return f"{' '.join(['rrfp-async', *path])} has no option {opt}"
            if rest and not rest[0].startswith("-") and _takes_value(cmd, opt):
                rest.pop(0)
        if not rest:
            break
        sub = cmd.get_command(click.Context(cmd), rest[0])  # (plug-ins: asked for)
        if sub is None:
            return f"{' '.join(['rrfp-async', *path])} has no command {rest[0]!r}"
        path.append(rest.pop(0))
        cmd = sub
    res = CliRunner().invoke(_cli_main(), [*path, "--help"])
    if res.exit_code != 0:
        return f"rrfp-async {' '.join(path)} --help exited {res.exit_code}: {res.output}"
    missing = [o for o in _options(rest) if o not in _opts_of(cmd) and o != "..."]
    if missing:
        return f"rrfp-async {' '.join(path)} takes no {missing}"
    return None


def _opts_of(cmd: click.Command) -> set[str]:
    out = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            out.update(p.opts)
            out.update(p.secondary_opts)
    return out


def _takes_value(cmd: click.Command, opt: str) -> bool:
    for p in cmd.params:
        if isinstance(p, click.Option) and opt in p.opts:
            return not p.is_flag
    return False


def _dev_commands() -> set[str]:
    src = (ROOT / "dev").read_text(encoding="utf-8")
    body = src[src.index('case "$cmd" in') :]
    return set(re.findall(r"^\s+([a-z0-9-]+)\)", body, re.M))


def _script_check(words: list[str]) -> tuple[str, list[str]] | str:
    """For ``python examples/x.py ...`` / ``torchrun ... examples/x.py ...``: the script and
    the options used, or why the command is wrong."""
    idx = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    if idx is None:
        return f"no script in {' '.join(words)!r}"
    script = words[idx]
    if not (ROOT / script).is_file():
        return f"{script}: no such file"
    return script, _options(words[idx + 1 :])


def _help_of(script: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return got.returncode, got.stdout + got.stderr


def _all_commands() -> dict[str, set[str]]:
    cmds: dict[str, set[str]] = {}
    for pg in _pages():
        for line in _command_lines(pg):
            cmds.setdefault(line, set()).add(pg.name)
    return cmds


def test_command_lines_are_found() -> None:
    """The command check is not vacuous: fenced and inline commands are both read."""
    pg = _page(ROOT / "README.md")
    lines = _command_lines(pg)
    assert any(line.startswith("./dev demo") for line in lines), lines
    assert _tokens("rrfp-async bench soak [--steps 500] | tee x  # note") == [
        "rrfp-async",
        "bench",
        "soak",
        "--steps",
        "500",
    ]
    assert _check_rrfp_async(["bench", "peer", "--no-such-option"]) is not None
    assert _check_rrfp_async(["bench", "no-such-command"]) is not None
    assert _check_rrfp_async(["--log-format", "json", "bench", "peer", "--json"]) is None


@pytest.mark.timeout(600)
def test_commands_exist_and_take_their_options() -> None:
    """Every command line in the pages: its subcommand exists, ``--help`` runs, and it takes
    every option the line uses (a renamed option breaks the docs, not the reader)."""
    bad: dict[str, str] = {}
    scripts: dict[str, set[str]] = {}  # script -> options used anywhere
    dev = _dev_commands()
    cmds = _all_commands()
    for line, where in sorted(cmds.items()):
        words = _tokens(line)
        tag = f"{line} ({', '.join(sorted(where))})"
        if words[0] == "rrfp-async":
            why = _check_rrfp_async(words[1:])
            if why:
                bad[tag] = why
        elif words[0] == "./dev":
            if len(words) > 1 and words[1] not in dev:
                bad[tag] = f"./dev has no command {words[1]!r} (it has {sorted(dev)})"
        elif "-m" in words[:-1] and words[words.index("-m") + 1].split(".")[0] in _PEERS:
            continue  # a peer's own command (torchrun -m torchtitan.train): its flags are its
        else:
            got = _script_check(words)
            if isinstance(got, str):
                bad[tag] = got
            else:
                scripts.setdefault(got[0], set()).update(got[1])
    assert scripts, "no script commands found"

    def check(item: tuple[str, set[str]]) -> tuple[str, str | None]:
        script, opts = item
        if "argparse" not in (ROOT / script).read_text(encoding="utf-8"):
            # No option parser: --help would run the script; it must take no options.
            return script, (f"takes no options, the docs give {sorted(opts)}" if opts else None)
        rc, out = _help_of(script)
        if rc != 0:
            return script, f"--help exited {rc}: {out[-2000:]}"
        missing = sorted(o for o in opts if not re.search(rf"(?<![\w-]){re.escape(o)}\b", out))
        return script, (f"takes no {missing}" if missing else None)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for script, why in pool.map(check, sorted(scripts.items())):
            if why:
                bad[script] = why
    assert not bad, "commands in the docs that do not run as written:\n" + "\n".join(
        f"  {k}: {v}" for k, v in bad.items()
    )


# ---- invariants -------------------------------------------------------------------------

_INVARIANT_REF = re.compile(r"\binvariants?\s+(\d+(?:\s*(?:,|/|and|or|&)\s*\d+)*)", re.IGNORECASE)


def _invariants() -> list[int]:
    """The numbers of ARCHITECTURE.md's "## Invariants" list, in order."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    _, found, section = text.partition("\n## Invariants\n")
    assert found, "ARCHITECTURE.md has no '## Invariants' section"
    section = section.split("\n## ", 1)[0]
    return [int(n) for n in re.findall(r"^(\d+)\. ", section, re.M)]


def _cited_invariants(text: str) -> list[tuple[int, int]]:
    """``(line, number)`` for each invariant a text cites ("invariant 8", "invariants 3 and
    6", "invariant 8/10")."""
    out = []
    for m in _INVARIANT_REF.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out += [(line, int(n)) for n in re.findall(r"\d+", m.group(1))]
    return out


def test_the_invariants_are_numbered() -> None:
    assert _invariants() == list(range(1, 12))


def test_invariant_references_exist() -> None:
    """Code and docs cite the runtime's invariants by number; each cited number is one of
    ARCHITECTURE.md's (a number the list does not have fails, as references to an
    unnumbered list did)."""
    known = set(_invariants())
    files = [
        *PAGES,
        *(
            p
            for d in ("rrfp_async", "rrfp_lab", "tests", "examples", "scripts")
            for p in (ROOT / d).rglob("*.py")
        ),
    ]
    bad, seen = [], 0
    for f in files:
        for line, n in _cited_invariants(f.read_text(encoding="utf-8")):
            seen += 1
            if n not in known:
                bad.append(f"{f.relative_to(ROOT)}:{line} cites invariant {n}")
    assert seen, "no invariant is cited anywhere (is the pattern wrong?)"
    assert not bad, f"invariants that ARCHITECTURE.md does not number ({sorted(known)}): {bad}"


def test_cited_invariants_are_found() -> None:
    assert _cited_invariants("keeps invariant 8; see invariants 3 and 6,\nand invariant 8/10") == [
        (1, 8),
        (1, 3),
        (1, 6),
        (2, 8),
        (2, 10),
    ]


# ---- runtime docstrings age well --------------------------------------------------------
#
# A docstring or comment of the runtime says what and why; a measured number, a date or a
# note about the machine it was measured on ages, and belongs in BENCHMARKS.md (link it:
# ``BENCHMARKS.md#anchor``). What counts:
#
# * a timing that reads as a measurement: a duration (``60 µs``, ``2 ms``, ``1.5 s``) with a
#   measurement's words near it ("about", "~", "here", "takes", "measured", "runs",
#   "against", "on a busy/loaded host", "quiet", "median"); a setting ("backing off from
#   20 µs to 1 ms", "``RRFP_NCCL_RULES_LAG``, 1 ms") is not one;
# * a date (``2026-12``);
# * a machine note: "this machine", "this VM", "2-core".

_TIMING = re.compile(r"(?<![\w.])~?\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)? ?(?:ms|µs|us|ns|s)\b")
_MEASURED = re.compile(
    r"~|\b(?:about|here|takes|took|measured|runs|against|loaded|busy|quiet|median|this"
    r" machine)\b",
    re.IGNORECASE,
)
_DATE = re.compile(r"\b20\d\d-\d\d\b")
_MACHINE = re.compile(r"\bthis (?:machine|VM|box)\b|\b\d+-core\b", re.IGNORECASE)

#: ``(module, the phrase found) -> why`` for the runtime's lab notes in the packages being
#: recomposed (issue 39): their branches move the numbers to BENCHMARKS.md, and this list is
#: emptied when they merge. Do not add to it.
LAB_NOTES_ALLOWED: dict[tuple[str, str], str] = {}


def _doc_texts(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of a module's docstrings (module, classes, functions) and comments."""
    import io
    import tokenize

    src = path.read_text(encoding="utf-8")
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _lab_notes(text: str) -> list[tuple[str, int]]:
    """``(phrase, offset)`` of each measured timing, date and machine note in ``text``."""
    found = []
    for m in _TIMING.finditer(text):
        para_start = text.rfind("\n\n", 0, m.start()) + 1
        para_end = text.find("\n\n", m.end())
        window = text[max(para_start, m.start() - 80) : m.end() + 60]
        if para_end != -1:
            window = text[max(para_start, m.start() - 80) : min(para_end, m.end() + 60)]
        if _MEASURED.search(window):
            found.append((m.group(0), m.start()))
    found += [(m.group(0), m.start()) for m in _DATE.finditer(text)]
    found += [(m.group(0), m.start()) for m in _MACHINE.finditer(text)]
    return found


def _runtime_lab_notes() -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted((ROOT / "rrfp_async").rglob("*.py")):
        rel = path.relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for line, text in _doc_texts(path):
            for phrase, at in _lab_notes(text):
                where = line + text.count("\n", 0, at)
                out.setdefault((module, phrase), []).append(f"{rel}:{where}: {phrase!r}")
    return out


def test_runtime_docstrings_carry_no_lab_notes() -> None:
    """No measured timing, date or machine note in the runtime's docstrings and comments:
    they go stale where they are; BENCHMARKS.md dates and re-measures its figures."""
    found = _runtime_lab_notes()
    bad = [w for key, where in sorted(found.items()) if key not in LAB_NOTES_ALLOWED for w in where]
    assert not bad, (
        "lab notes in runtime docstrings or comments (move the number to BENCHMARKS.md and "
        "link it, or say what the code does instead):\n" + "\n".join(bad)
    )


def test_every_lab_note_allowance_is_still_needed() -> None:
    found = _runtime_lab_notes()
    for key, why in LAB_NOTES_ALLOWED.items():
        assert why.strip(), f"allowance {key} gives no reason"
        assert key in found, f"allowance {key} no longer matches a note: drop it"


def test_lab_notes_are_found() -> None:
    """The check sees measurements, dates and machine notes, and lets settings be."""
    notes = [p for p, _ in _lab_notes("A call takes about 60 µs less here.")]
    assert notes == ["60 µs"]
    assert [p for p, _ in _lab_notes("3.5 us against ~150 us on this machine")] == [
        "3.5 us",
        "~150 us",
        "this machine",
    ]
    assert [p for p, _ in _lab_notes("measured 2026-12-06 on the 2-core VM")] == [
        "2026-12",
        "2-core",
    ]
    assert _lab_notes("backing off exponentially from 20 µs to 1 ms, then at that period") == []
    assert _lab_notes("the default step_timeout is 30 s.") == []

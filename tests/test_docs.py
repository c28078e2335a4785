"""The README, ``docs/`` and ``benchmarks/RESULTS.md`` stay true to the code.

Every Python block parses and imports only what exists; every bash block passes ``bash -n``;
every ``tapllm SUBCOMMAND --flag`` names a subcommand and flags of the real parser, and every
``--hidden-states`` spec parses; every ``python benchmarks/x.py --flag`` names a script and a
flag it defines; every relative link and ``#anchor`` resolves; the README keeps the set-up
commands CI runs and stays short. Nothing here loads a model: the whole file takes seconds.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
import re
import shlex
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]
MAX_README_LINES = 250
# What .ci/run runs, and what the README promises a fresh machine.
TEST_COMMAND = "bash scripts/install.sh --test && .venv/bin/python -m pytest -q"
MAIN_COMMAND_START = "bash scripts/install.sh && .venv/bin/tapllm generate "
# Scripts the docs announce before they land (the GPU row of the results): allowed to be missing.
PENDING_SCRIPTS = {"benchmarks/gpu.py"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")
LINK = re.compile(r"!?\[(?:[^\]\n]|\n(?!\n))*\]\(([^)\s]+)\)")
SHELL_OPERATORS = re.compile(r"\s(?:&&|\|\||\||;)\s|;$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            indent = len(m.group("indent"))
            body = "\n".join(line[indent:] for line in m.group("body").splitlines()) + "\n"
            out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group("lang").lower(), body))
    return out


BLOCKS = _blocks()


def _prose(page: Path) -> str:
    """The page without its fenced blocks (each replaced by blank lines, so line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())


def _of(lang: str | tuple[str, ...]) -> list[Block]:
    langs = (lang,) if isinstance(lang, str) else lang
    return [b for b in BLOCKS if b.lang in langs]


def test_the_pages_exist_and_have_code():
    assert (ROOT / "docs" / "README.md").is_file()
    assert _of("python") and _of(("bash", "sh")), "no code blocks found: the fence pattern is broken"


def test_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_set_up_commands_are_the_ones_ci_runs():
    readme = README.read_text()
    assert TEST_COMMAND in readme.splitlines()
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci.splitlines(), ".ci/run no longer runs the README's test command"
    main = [line for line in readme.splitlines() if line.startswith(MAIN_COMMAND_START)]
    assert len(main) == 1, "the README's install-and-run command is missing"
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert '"--test"' in install, "scripts/install.sh no longer takes --test"


# ---------------------------------------------------------------- code blocks


@pytest.mark.parametrize("block", _of("python"), ids=str)
def test_python_blocks_parse(block: Block):
    ast.parse(block.body, filename=str(block))


@pytest.mark.parametrize("block", _of(("bash", "sh")), ids=str)
def test_bash_blocks_parse(block: Block):
    r = subprocess.run(["bash", "-n"], input=block.body, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"{block}: {r.stderr}"


@pytest.mark.parametrize("block", _of("toml"), ids=str)
def test_toml_blocks_parse(block: Block):
    tomllib.loads(block.body)


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level, plus its submodules (for a package)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):  # lazy exports (PEP 562)
                names.update(ast.literal_eval(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if path.name == "__init__.py":
        names.update(p.stem for p in path.parent.glob("*.py"))
        names.update(p.parent.name for p in path.parent.glob("*/__init__.py"))
    return names


@pytest.mark.parametrize("block", _of("python"), ids=str)
def test_python_blocks_import_only_what_exists(block: Block):
    """``from tapllm... import X`` and ``import tapllm.x`` name real modules and names (read from source)."""
    for node in ast.walk(ast.parse(block.body)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tapllm":
            path = _module_file(node.module)
            assert path is not None, f"{block}: no module {node.module}"
            missing = {a.name for a in node.names} - _top_level_names(path)
            assert not missing, f"{block}: {node.module} has no {sorted(missing)}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tapllm":
                    assert _module_file(alias.name) is not None, f"{block}: no module {alias.name}"


# ---------------------------------------------------------------- commands


class _Captured(BaseException):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextmanager
def _capturing_parse_args() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


@cache
def cli_parser() -> argparse.ArgumentParser:
    """The ``tapllm`` command's parser, whether ``tapllm.cli`` is a module or a package.

    A builder function (``build_parser`` and the like) is preferred; failing that, the console
    script's entry point from pyproject.toml is called and the parser it builds is caught as it
    starts parsing.
    """
    cli = importlib.import_module("tapllm.cli")
    modules = [cli]
    if hasattr(cli, "__path__"):
        modules += [importlib.import_module(m.name) for m in pkgutil.walk_packages(cli.__path__, "tapllm.cli.")]
    for module in modules:
        for name in ("build_parser", "make_parser", "create_parser", "get_parser"):
            builder = getattr(module, name, None)
            if callable(builder):
                parser = builder()
                if isinstance(parser, argparse.ArgumentParser):
                    return parser
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["tapllm"]
    module_name, func = target.split(":")
    main = getattr(importlib.import_module(module_name), func)
    with _capturing_parse_args():
        try:
            main(["generate", "x"])
        except _Captured as captured:
            return captured.parser
    raise AssertionError(f"{target} built no argparse parser")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the tapllm parser has no subcommands")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


@dataclass(frozen=True)
class Command:
    where: str
    text: str
    inline: bool = False  # a code span in prose, which may name the command alone


def _shell_lines(body: str) -> list[str]:
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", body).splitlines() if line.strip()]


def _commands() -> list[Command]:
    """Every command line of the bash blocks, and every inline code span that is a command."""
    out = []
    for block in _of(("bash", "sh")):
        out += [Command(str(block), line) for line in _shell_lines(block.body)]
    for page in PAGES:
        prose = _prose(page)
        for m in INLINE_CODE.finditer(prose):
            span = " ".join(m.group(1).split())
            if re.match(r"(\S*/)?tapllm\s|python3?\s+(-m\s+tapllm|\S+\.py)(\s|$)|\w+=\S+\s", span):
                line = prose.count("\n", 0, m.start()) + 1
                out.append(Command(f"{page.relative_to(ROOT)}:{line}", span, inline=True))
    return out


COMMANDS = _commands()


def _tokens(segment: str) -> list[str]:
    try:
        return shlex.split(segment, comments=True)
    except ValueError:  # a placeholder with an unbalanced quote: words are enough to find flags
        return segment.split()


def _segments(text: str) -> list[list[str]]:
    return [t for t in (_tokens(s) for s in SHELL_OPERATORS.split(text)) if t]


def _option(token: str) -> str | None:
    token = token.strip("[](),")
    if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", token) or re.fullmatch(r"-[a-zA-Z]", token):
        return token.split("=")[0]
    return None


def _tapllm_invocations() -> list[tuple[Command, list[str]]]:
    """(command, the tokens after ``tapllm``) for every ``tapllm`` / ``python -m tapllm`` call."""
    out = []
    for cmd in COMMANDS:
        for tokens in _segments(cmd.text):
            for i, tok in enumerate(tokens):
                if tok == "tapllm" or tok.endswith("/tapllm"):
                    if i == 0 or tokens[i - 1] == "-m" or "=" in tokens[i - 1] or tok.endswith("/tapllm"):
                        out.append((cmd, tokens[i + 1:]))
                        break
    return out


INVOCATIONS = _tapllm_invocations()


def test_commands_were_found():
    subcommands = {rest[0] for _, rest in INVOCATIONS if rest}
    assert {"generate", "serve", "collect"} <= subcommands, subcommands


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda inv: inv[0].where)
def test_tapllm_commands_name_real_subcommands_and_flags(invocation):
    cmd, rest = invocation
    parser = cli_parser()
    subs = _subparsers(parser)
    if not rest:
        assert cmd.inline, f"{cmd.where}: `{cmd.text}` names no subcommand"
        return
    word = rest[0].strip("[]")
    if word == "..." or word.isupper():  # a placeholder: each flag must exist in some subcommand
        known = set().union(*(_flags(p) for p in subs.values()))
        names = list(subs)
    else:
        names = word.split("|")
        unknown = [n for n in names if n not in subs]
        assert not unknown, f"{cmd.where}: `{cmd.text}`: no subcommand {unknown} (have {sorted(subs)})"
        known = set.intersection(*(_flags(subs[n]) for n in names))
    for token in rest[1:]:
        flag = _option(token)
        if flag is not None:
            assert flag in known, f"{cmd.where}: `{cmd.text}`: `tapllm {'|'.join(names)}` has no flag {flag}"


@pytest.mark.parametrize("invocation", [inv for inv in INVOCATIONS if "--hidden-states" in inv[1]],
                         ids=lambda inv: inv[0].where)
def test_hidden_states_specs_on_the_command_line_parse(invocation):
    from tapllm import HiddenStatesSpec

    cmd, rest = invocation
    i = rest.index("--hidden-states")
    assert i + 1 < len(rest), f"{cmd.where}: --hidden-states without a spec"
    HiddenStatesSpec.parse(rest[i + 1])


def _script_invocations() -> list[tuple[Command, Path, list[str]]]:
    out = []
    for cmd in COMMANDS:
        for tokens in _segments(cmd.text):
            for i, tok in enumerate(tokens[:-1]):
                if re.fullmatch(r"(\S*/)?python3?", tok) and tokens[i + 1].endswith(".py"):
                    out.append((cmd, ROOT / tokens[i + 1], tokens[i + 2:]))
                    break
    return out


@pytest.mark.parametrize("invocation", _script_invocations(), ids=lambda inv: inv[0].where)
def test_script_commands_name_real_scripts_and_flags(invocation):
    cmd, script, rest = invocation
    if not script.is_file() and str(script.relative_to(ROOT)) in PENDING_SCRIPTS:
        return
    assert script.is_file(), f"{cmd.where}: `{cmd.text}`: no file {script.relative_to(ROOT)}"
    source = script.read_text()
    for token in rest:
        flag = _option(token)
        if flag is not None:
            assert f'"{flag}"' in source, f"{cmd.where}: `{cmd.text}`: {script.name} defines no {flag}"


# ---------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _links() -> list[tuple[str, Path, str]]:
    out = []
    for page in PAGES:
        prose = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), _prose(page))
        for m in LINK.finditer(prose):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            line = prose.count("\n", 0, m.start()) + 1
            out.append((f"{page.relative_to(ROOT)}:{line}", page, target))
    return out


LINKS = _links()


def test_links_were_found():
    assert any("#" in target for _, _, target in LINKS) and len(LINKS) > 20


@pytest.mark.parametrize("link", LINKS, ids=lambda link: f"{link[0]} {link[2]}")
def test_relative_links_and_anchors_resolve(link):
    where, page, target = link
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{where}: {target}: no such file {dest}"
    if anchor:
        assert dest.suffix == ".md", f"{where}: {target}: an anchor into a file that is not markdown"
        assert anchor in _anchors(dest), f"{where}: {target}: no heading #{anchor} in {dest.name}"

"""The handouts and the instructor's guide say only what the kit has.

Every ```bash block of the three documents parses (`bash -n`); every `onenode` / `onenode-grade`
command in it names a subcommand, options and (for the grader) a rubric profile that exist, read
from the same parsers `--help` prints; every kit script or config it names exists. A block right
after `<!-- gpu -->` or `<!-- slow -->` is only checked. Every other block of the handouts runs,
in document order, in a scratch repository laid out like the students' one, and must print what
a ```text block right after it shows; the A1 blocks must leave a submission the grader's own
intake accepts. The instructor's commands run on a grading node from the kit root, so each of
its blocks must be marked. The blocks of the kit README, `benchmarks/README.md` and every record's
README are checked the same way (not run), and a kit script with subcommands (`make_patches.py`,
`step_probes.py`) must be given one it has. Every relative link of these documents and of
`docs/` names a file of the kit.

Figures, in these three and in the kit README and `benchmarks/README.md`: a figure linked to its
record, `[12.07x](../benchmarks/results/.../part1-moe.json "extra_data.numbers.moe_speedup")`, or
to the rubric that sets it, `[8x](../a1_infra/rubric.toml "profiles.h200x1.speed.moe_layer.1")`,
must match the value at that key; every other figure in a unit a GPU measurement comes in
(a speedup `3.2x`, a percentage, tokens/s, GiB, ms, TFLOP/s, TB/s) must be such a link, a
datasheet constant (`SPEC_FIGURES`), in code, or in a paragraph or table marked
`<!-- not measured -->` (estimates, derived FLOP counts, requirements). The A1 handout's rubric
table must match `a1_infra/rubric.toml`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parents[1]
INSTRUCTOR = "docs/INSTRUCTOR.md"
DOCS = ("a1_infra/README.md", "a2_pretrain/README.md", INSTRUCTOR)
FIGURE_DOCS = ("README.md", *DOCS, "benchmarks/README.md")
# Commands are checked (not run) in these too: the records' READMEs say how each record was made.
RECORD_READMES = tuple(str(p.relative_to(KIT)) for p in sorted((KIT / "benchmarks/results").glob("*/README.md")))
CHECKED_DOCS = (*FIGURE_DOCS, *RECORD_READMES)
# Kit scripts whose first argument is a subcommand (or probe) of theirs.
SCRIPTS_WITH_SUBCOMMANDS = ("solutions/a1/make_patches.py", "benchmarks/step_probes.py")
BLOCK = re.compile(r"^(?P<indent>[ \t]*)```bash\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
OUTPUT = re.compile(r"\s*(?:[^\n`]{0,40}\n)?\s*```text\n(?P<output>.*?)```", re.S)
MARKER = re.compile(r"<!--\s*(gpu|slow)\s*-->\s*$")
RECORD_LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<path>[^ )]*(?:\.json|rubric\.toml)) "
                         r"\"(?P<key>[^\"]+)\"\)")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# A figure in a unit GPU measurements come in: 13.5x, 27.2%, 2,436 tokens/s, 45.6 GiB, 91.6 ms, ...
GPU_FIGURE = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?:x(?!\w)|\s?%|\s(?:tokens/s|tok/s|GiB|ms|TFLOP/s|TB/s)(?!\w))")
SPEC_FIGURES = {"989 TFLOP/s": "the dense bf16 peak of H100 SXM and H200, from NVIDIA's datasheet"}
NOT_MEASURED = "<!-- not measured -->"
KIT_FILE = re.compile(r"^(?:a1_infra|a2_pretrain|assignments|benchmarks|cluster|examples|solutions|starter_code)/"
                      r"\S+\.(?:sh|sbatch|py|yaml|toml|md|json)$")
RUBRICS = {"onenode-grade a1": "a1_infra/rubric.toml", "onenode-grade demo": "a1_infra/rubric.toml",
           "onenode-grade a2": "a2_pretrain/rubric.toml"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}


def blocks(doc: str) -> list[tuple[str, str | None, int, str | None]]:
    """(script, marker or None, line number, expected output or None) of every bash block of
    `doc`; the expected output is a ```text block right after it (an intro line like "prints"
    allowed)."""
    text = (KIT / doc).read_text(encoding="utf-8")
    found = []
    for m in BLOCK.finditer(text):
        before = text[:m.start()].rstrip().splitlines()
        marker = MARKER.search(before[-1]) if before else None
        indent = len(m.group("indent"))
        body = "".join(line[indent:] if line[:indent].isspace() else line
                       for line in m.group("body").splitlines(keepends=True))
        output = OUTPUT.match(text, m.end())
        found.append((body, marker.group(1) if marker else None, text.count("\n", 0, m.start()) + 1,
                      output.group("output") if output else None))
    return found


def all_blocks() -> list[tuple[str, str, int]]:
    """(document, script, line) of every block of every document whose commands are checked."""
    return [(doc, script, line) for doc in CHECKED_DOCS if (KIT / doc).is_file()
            for script, _, line, _ in blocks(doc)]


def simple_commands(script: str) -> list[list[str]]:
    """The words of each simple command (split at lines, ;, &&, ||, |, &, parentheses), comments
    and redirections dropped, backslash continuations joined."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words, skip = [], False
        for token in lexer:
            if skip:
                skip = False
            elif token in SEPARATORS:
                commands.append(words)
                words = []
            elif token in (">", ">>", "<", "2>", "&>"):
                skip = True
            else:
                words.append(token)
        commands.append(words)
    return [c for c in commands if c]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """(program, arguments) if one simple command runs a kit CLI: `onenode ...`,
    `.venv/bin/onenode-grade ...` (after any VAR=value), `python -m onenode.cli ...` (also under
    torchrun)."""
    modules = {"onenode.cli": "onenode", "grader.cli": "onenode-grade"}
    first = next((i for i, w in enumerate(words) if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)), len(words))
    if first < len(words) and words[first].rsplit("/", 1)[-1] in modules.values():
        return words[first].rsplit("/", 1)[-1], words[first + 1:]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1] in modules:
            return modules[words[i + 1]], words[i + 2:]
    return None


def check_invocation(parsers, program: str, args: list[str]) -> str | None:
    """None if `program args` names a real subcommand with real options, else what is wrong."""
    parser, path = parsers[program], [program]
    while (choices := _subparsers(parser)) and args and not args[0].startswith("-"):
        if args[0] not in choices:
            return f"`{' '.join(path)} {args[0]}`: no such subcommand (has {', '.join(choices)})"
        parser = choices[args[0]]
        path.append(args.pop(0))
    if _subparsers(parser):
        return f"`{' '.join(path)}` needs a subcommand"
    known = {opt for action in parser._actions for opt in action.option_strings}
    unknown = [a.split("=", 1)[0] for a in args if a.startswith("--") and a.split("=", 1)[0] not in known]
    if unknown:
        return f"`{' '.join(path)}` has no option {', '.join(unknown)} (see `{' '.join(path)} --help`)"
    rubric = RUBRICS.get(" ".join(path[:2]))
    profile = next((value for option, value in zip(args, args[1:] + [""]) if option == "--profile"), None)
    if rubric and profile:
        from grader.rubric import tomllib

        profiles = tomllib.loads((KIT / rubric).read_text())["profiles"]
        if profile not in profiles:
            return f"`{' '.join(path)} --profile {profile}`: {rubric} has no such profile (has {', '.join(profiles)})"
    return None


def script_subcommands(path: str) -> set[str]:
    """The subcommands (`add_parser` names) and choices of the positional arguments that a kit
    script's argparse parser declares, read from its source without running it."""
    import ast

    names = set()
    for node in ast.walk(ast.parse((KIT / path).read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        if node.func.attr == "add_parser":
            names.add(first.value)
        elif node.func.attr == "add_argument" and not first.value.startswith("-"):
            for keyword in node.keywords:
                if keyword.arg == "choices" and isinstance(keyword.value, (ast.List, ast.Tuple)):
                    names |= {e.value for e in keyword.value.elts if isinstance(e, ast.Constant)}
    return names


def wrong_subcommands(script: str) -> list[str]:
    """`script word` for every run of a kit script of SCRIPTS_WITH_SUBCOMMANDS whose first argument
    is not one of its subcommands."""
    wrong = []
    for words in simple_commands(script):
        for i, word in enumerate(words[:-1]):
            path = next((p for p in SCRIPTS_WITH_SUBCOMMANDS if word == p or word.endswith("/" + p)), None)
            known = script_subcommands(path) if path else set()
            if path and words[i + 1] not in known:
                wrong.append(f"`{path} {words[i + 1]}`: no such subcommand (has {', '.join(sorted(known))})")
    return wrong


def missing_kit_files(script: str) -> list[str]:
    """Kit scripts and configs the block names that the kit does not have (files the block
    itself creates with `cp` excepted)."""
    commands = simple_commands(script)
    created = {words[-1] for words in commands if words[0] == "cp"}
    return [word for words in commands for word in words
            if KIT_FILE.match(word) and word not in created and not (KIT / word).is_file()]


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    from grader.cli import build_parser as grade_parser
    from onenode.cli import build_parser as onenode_parser

    return {"onenode": onenode_parser(), "onenode-grade": grade_parser()}


def test_documents_have_command_blocks():
    for doc in DOCS:
        assert (KIT / doc).is_file(), f"{doc} is missing"
        assert blocks(doc), f"{doc} has no ```bash block"


@pytest.mark.parametrize("doc,script,line", [pytest.param(*b, id=f"{b[0]}:{b[2]}") for b in all_blocks()])
def test_block_parses_and_names_real_commands(parsers, doc, script, line):
    parsed = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert parsed.returncode == 0, f"{doc}:{line}: bash cannot parse the block: {parsed.stderr.strip()}"
    calls = [call for words in simple_commands(script) if (call := invocation(words))]
    problems = [problem for program, args in calls if (problem := check_invocation(parsers, program, list(args)))]
    problems += [f"no {path} in the kit" for path in missing_kit_files(script)]
    problems += wrong_subcommands(script)
    assert not problems, f"{doc}:{line}: " + "; ".join(problems)


def test_invocation_checker_catches_mistakes(parsers):
    """The checker itself: a wrong subcommand or option is reported, a right one is not."""
    ok = simple_commands(".venv/bin/onenode bench --preset tiny --steps 5 --profile prof/ > log.txt")
    assert check_invocation(parsers, *invocation(ok[0])) is None
    torchrun = simple_commands("torchrun --standalone --nproc-per-node 2 -m onenode.cli bench --ep 2 \\\n  --pp 2")
    assert check_invocation(parsers, *invocation(torchrun[0])) is None
    assert "no option --stepz" in check_invocation(parsers, "onenode", ["bench", "--stepz", "3"])
    assert "no such subcommand" in check_invocation(parsers, "onenode-grade", ["a3", "--out", "x"])
    assert "no such subcommand" in check_invocation(parsers, "onenode", ["data", "explode"])
    assert "no such profile" in check_invocation(parsers, "onenode-grade", ["a1", "--profile", "tpu", "--out", "x"])
    assert check_invocation(parsers, "onenode-grade", ["a2", "--profile", "h100x8", "--out", "x"]) is None
    assert wrong_subcommands("python3 solutions/a1/make_patches.py copy /tmp/x\n"
                             "python3 ../../../benchmarks/step_probes.py tf32 -- --steps 2") == []
    assert [w[:40] for w in wrong_subcommands("python3 solutions/a1/make_patches.py checkout /tmp/x")] == [
        "`solutions/a1/make_patches.py checkout`:"]
    assert missing_kit_files("cluster/nope.sh a b\ncp a2_pretrain/recipes/tiny.yaml a2_pretrain/recipes/x.yaml\n"
                             "onenode train a2_pretrain/recipes/x.yaml") == ["cluster/nope.sh"]


# -- figures -----------------------------------------------------------------------------------
def _at(record, key: str):
    for part in key.split("."):
        record = record[int(part)] if isinstance(record, list) else record[part]
    return record


def matches(text: str, value: float) -> bool:
    """The first number of `text` is `value` (or `value` as a percentage) to its shown digits."""
    shown = NUMBER.search(text)
    if shown is None:
        return False
    number = float(shown.group().replace(",", ""))
    mantissa, scientific, _ = shown.group().partition("e")
    if scientific:  # 1.4e20: to its shown significant digits
        digits = len(mantissa.lstrip("-+").replace(".", "")) - 1
        return float(f"{value:.{digits}e}") == number
    digits = len(mantissa.partition(".")[2])
    return any(round(v, digits) == number for v in (value, 100 * value))


def test_figure_matcher():
    assert matches("13.5x", 13.4915) and matches("14,444 tok/s", 14444.19) and matches("3.38%", 0.03379)
    assert matches("-0.31", -0.3135) and matches("+0.02", 0.0152)
    assert not matches("13.6x", 13.4915) and not matches("0.31", -0.3135) and not matches("fast", 1.0)
    assert matches("1.4e20", 1.354e20) and matches("2.94e-05", 2.9415e-05) and matches("6e-5", 6.2e-5)
    assert not matches("1.3e20", 1.354e20) and not matches("2.9e-4", 2.9415e-05)


def _load(path: Path):
    from grader.rubric import tomllib

    return tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())


@pytest.mark.parametrize("doc", (*FIGURE_DOCS, *RECORD_READMES))
def test_linked_figures_match_their_records(doc):
    path = KIT / doc
    for m in RECORD_LINK.finditer(path.read_text(encoding="utf-8")):
        record_path = (path.parent / m.group("path")).resolve()
        assert record_path.is_file(), f"{doc}: {m.group('path')} does not exist"
        try:
            value = _at(_load(record_path), m.group("key"))
        except (KeyError, IndexError, ValueError) as e:
            raise AssertionError(f"{doc}: {m.group('path')} has no key {m.group('key')!r} ({e!r})") from None
        if isinstance(value, bool):  # a record's yes/no fact (`verified`): the text says it
            assert m.group("text").lower() == str(value).lower(), (
                f"{doc}: [{m.group('text')}] but {m.group('path')} has {m.group('key')} = {value}")
            continue
        assert matches(m.group("text"), float(value)), (
            f"{doc}: [{m.group('text')}] but {m.group('path')} has {m.group('key')} = {value}")


def test_the_handouts_link_figures_to_records():
    linked = [m for doc in DOCS for m in RECORD_LINK.finditer((KIT / doc).read_text(encoding="utf-8"))]
    assert [m for m in linked if "benchmarks/results/" in m.group("path")], "no figure links a record"


def unlinked_figures(text: str) -> list[tuple[int, str]]:
    """(line, figure) of every GPU-like figure of a Markdown text that is not a link to its
    record or rubric, not a datasheet constant, not in code and not in a block marked
    NOT_MEASURED (up to the next blank line)."""
    def blank(m: re.Match) -> str:  # keep the line numbers
        return re.sub(r"[^\n]", " ", m.group())

    text = BLOCK.sub(blank, text)
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```", blank, text, flags=re.M | re.S)
    text = re.sub(re.escape(NOT_MEASURED) + r".*?(?:\n[ \t]*\n|\Z)", blank, text, flags=re.S)
    text = RECORD_LINK.sub(blank, text)
    text = re.sub(r"`[^`\n]*`", blank, text)
    text = re.sub(r"<[a-z]+://[^>\s]*>|\]\([^)\s]*\)", blank, text)  # URLs and link targets
    for spec in SPEC_FIGURES:
        text = text.replace(spec, " " * len(spec))
    return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in GPU_FIGURE.finditer(text)]


def test_figure_finder():
    text = ("Measured [13.5x](../benchmarks/results/r/r.json \"k\") and 14.0x at 2 x 4096; "
            "2,436 tokens/s, 0.57%, 45.6 GiB.\n"
            "The `--steps 5` run, 989 TFLOP/s peak, layer 6.79 ms, 0.25 (chance), 1e-4, the x-axis.\n\n"
            f"{NOT_MEASURED}\nAbout 36 GiB of state, 20% at most.\n\nThen 31.2% again.\n"
            "```text\n50 GiB\n```\n")
    assert unlinked_figures(text) == [(1, "14.0x"), (1, "2,436 tokens/s"), (1, "0.57%"), (1, "45.6 GiB"),
                                      (2, "6.79 ms"), (7, "31.2%")]


@pytest.mark.parametrize("doc", FIGURE_DOCS)
def test_every_gpu_figure_links_its_record(doc):
    found = unlinked_figures((KIT / doc).read_text(encoding="utf-8"))
    assert not found, (f"{doc}: figures without their record: "
                       + ", ".join(f"line {line}: {figure!r}" for line, figure in found)
                       + f". Link each as [figure](path/to/record.json \"key\") (or to the rubric that sets it), "
                       f"or mark an estimate's paragraph {NOT_MEASURED}")


def _table_rows(doc: str) -> dict[str, list[str]]:
    """First cell -> the other cells, of every Markdown table row of `doc`."""
    rows = {}
    for line in (KIT / doc).read_text(encoding="utf-8").splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_rubric_tables_match_the_rubrics():
    from grader.rubric import tomllib

    rows = _table_rows("a1_infra/README.md")
    for part in tomllib.loads((KIT / "a1_infra/rubric.toml").read_text())["parts"].values():
        assert part["title"] in rows, f"the A1 handout's rubric table has no row for {part['title']!r}"
        rubric = [str(part.get(key, 0)) for key in ("correctness", "feature", "speed")]
        assert rows[part["title"]][:3] == rubric, (
            f"{part['title']}: the handout says {rows[part['title']][:3]} (correctness, feature, speed), "
            f"rubric.toml {rubric}")
    a2 = tomllib.loads((KIT / "a2_pretrain/rubric.toml").read_text())
    rows = _table_rows("a2_pretrain/README.md")
    labels = {"budget": "token budget and run audit", "benchmarks": "benchmarks", "heldout": "held-out perplexity",
              "notebook": "report notebook"}
    for key, points in a2["points"].items():
        assert rows.get(labels.get(key, key), [None])[0] == str(points), (
            f"the A2 handout's table gives {key!r} {rows.get(labels.get(key, key))}, rubric.toml {points} points")
    budget = a2["profiles"]["h100x8"]["token_budget"]
    assert f"{budget:,}" in (KIT / "a2_pretrain/README.md").read_text(), (
        f"the A2 handout does not state the {budget:,}-token budget")


def test_public_tests_need_only_what_students_get():
    """The handout sends students to `pytest a1_infra/tests`; the release has no grader."""
    import ast

    for path in sorted((KIT / "a1_infra/tests").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        kit_only = sorted(name for name in imported if name.split(".")[0] in ("grader", "solutions", "benchmarks"))
        assert not kit_only, (f"{path.relative_to(KIT)} imports {', '.join(kit_only)}, which the student release "
                              "does not have (grader/release.py): the public test fails for every student")


# -- running the quick blocks ------------------------------------------------------------------
STUDENT_EDITS = ["starter_code/onenode/model/moe.py", "starter_code/onenode/model/student_helper.py"]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=student", "-c", "user.email=s@example.org", *args],
                   cwd=repo, check=True, capture_output=True)


def start_as_student(repo: Path) -> Path:
    """Commit `repo` as the handout (as its README says), give it the kit's environment as
    `.venv`, then change it as a student would: one file edited, one added, bytecode left behind."""
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "handout")
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    edited, added = (repo / path for path in STUDENT_EDITS)
    edited.write_text(edited.read_text() + "\n# a student's change\n")
    added.write_text('"""A new file."""\n')
    (edited.parent / "__pycache__").mkdir(exist_ok=True)
    (edited.parent / "__pycache__" / "moe.cpython-311.pyc").write_bytes(b"\x00binary")
    return repo


def run_quick_blocks(doc: str, repo: Path, tmpdir: Path) -> list[str]:
    """Run the unmarked blocks of `doc` in order in `repo`; what failed, with its output."""
    env = dict(os.environ, TMPDIR=str(tmpdir))
    failures = []
    for script, marker, line, expected in blocks(doc) if (KIT / doc).is_file() else []:
        if marker:
            continue
        if doc == INSTRUCTOR:
            failures.append(f"{doc}:{line}: mark the block <!-- slow --> or <!-- gpu -->: the instructor's "
                            "commands run on the grading node, from the kit root")
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            failures.append(f"{doc}:{line} exited {done.returncode}:\n{done.stdout[-1000:]}\n{done.stderr[-1000:]}")
        missing = [out for out in (expected or "").splitlines() if out.strip() and out.strip() not in done.stdout]
        if missing:
            failures.append(f"{doc}:{line}: the document says it prints {missing[0]!r}; "
                            f"it printed:\n{done.stdout[-1000:]}")
    return failures


def check_a1_submission(repo: Path, workdir: Path) -> None:
    """The A1 handout's blocks left an archive the grader's intake takes, holding the student's
    edit and new file and nothing else (no bytecode), that applies to the kit's starter."""
    from grader.submission import load_submission, patched_tree

    archive = repo / "submission.tar.gz"
    assert archive.is_file(), "the A1 handout's blocks made no submission.tar.gz"
    submission = load_submission(archive, workdir)
    assert sorted(submission.changed_files) == STUDENT_EDITS
    assert submission.notebook is not None, "no report.ipynb in the archive"
    tree = patched_tree(submission, workdir / "tree")
    assert (tree / STUDENT_EDITS[1]).is_file()


@pytest.fixture(scope="module")
def student_repo(tmp_path_factory) -> Path:
    """A repository laid out like the one `onenode-grade release` makes (quick to build)."""
    repo = tmp_path_factory.mktemp("student")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("starter_code", "a1_infra", "a2_pretrain"):
        shutil.copytree(KIT / folder, repo / folder, ignore=skip)
    (repo / "tests").mkdir()
    for name in ("conftest.py", "dist_utils.py"):
        shutil.copy2(KIT / "tests" / name, repo / "tests" / name)
    shutil.copy2(KIT / ".gitignore", repo / ".gitignore")
    shutil.copy2(KIT / "assignments/source/a1/report.ipynb", repo / "report.ipynb")
    return start_as_student(repo)


@pytest.fixture(scope="module")
def ran_blocks(student_repo, tmp_path_factory) -> dict[str, list[str]]:
    tmpdir = tmp_path_factory.mktemp("tmp")
    return {doc: run_quick_blocks(doc, student_repo, tmpdir) for doc in DOCS}


@pytest.mark.parametrize("doc", DOCS)
def test_quick_blocks_run(doc, ran_blocks):
    """Unmarked blocks run, in order, in a repository laid out like the students' one."""
    assert not ran_blocks[doc], "\n".join(ran_blocks[doc])


def test_a1_submission_is_accepted_by_the_grader(student_repo, ran_blocks, tmp_path):
    check_a1_submission(student_repo, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("assignment,doc", [("a1", DOCS[0]), ("a2", DOCS[1])])
def test_handout_runs_in_the_real_release(assignment, doc, tmp_path):
    """The same, in the repository `onenode-grade release` really builds (nbgrader, about a minute)."""
    pytest.importorskip("nbgrader")
    from grader.registry import ASSIGNMENTS
    from grader.release import release

    repo = start_as_student(release(ASSIGNMENTS[assignment], tmp_path / "student", tmp_path / "course"))
    assert (repo / doc).is_file(), f"the {assignment} release has no {doc}"
    failures = run_quick_blocks(doc, repo, tmp_path)
    assert not failures, "\n".join(failures)
    if assignment == "a1":
        check_a1_submission(repo, tmp_path / "intake")


@pytest.mark.slow  # builds the offline data (about a minute), trains the tiny model on it, evaluates it
def test_readme_a2_block_runs_from_data_to_evaluation(tmp_path):
    """The kit README's A2 block, as written, in a fresh copy of the kit: the data it builds is
    what the tiny model trains on, and the evaluation finds the tokenizer it needs in final/."""
    script = next(script for script, *_ in blocks("README.md") if "onenode data build" in script)
    repo = tmp_path / "kit"
    for folder in ("starter_code", "a2_pretrain"):
        shutil.copytree(KIT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(repo / "starter_code"))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, f"{done.stdout[-1000:]}\n{done.stderr[-2000:]}"
    manifest = json.loads((repo / "runs" / "tiny" / "run_manifest.json").read_text())
    assert manifest["recipe"]["data"] == {"source": "shards", "path": "data/default", "mixture": {}}
    assert "onenode_cloze" in done.stdout and " ± " in done.stdout


GUIDES = sorted({*CHECKED_DOCS, *(str(p.relative_to(KIT)) for p in (KIT / "docs").glob("*.md"))})


@pytest.mark.parametrize("doc", GUIDES)
def test_documents_link_only_to_files_of_the_kit(doc):
    """A relative link of a guide or record names a file the repository has (the student
    release's own check, `grader.release.dead_links`, covers what ships to students)."""
    from grader.release import relative_links

    path = KIT / doc
    dead = [target for target in relative_links(path.read_text(encoding="utf-8"))
            if not (resolved := (path.parent / target).resolve()).is_file() or KIT not in resolved.parents]
    assert not dead, f"{doc} links to {', '.join(dead)}, which the kit does not have"

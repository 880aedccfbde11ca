"""Find Megatron-LM's training code (``pretrain_gpt.py``, ``megatron/training``) for the installed megatron-core.

The megatron-core wheel ships ``megatron/core`` (from 0.19 also ``megatron/training``) but never
Megatron-LM's top-level scripts. :func:`find_tree` looks, in this order, at

1. ``MEGATRON_LM_DIR`` (a checkout or extracted archive; used as it is);
2. ``<repository>/../shared/vendor/Megatron-LM-core_vX.Y.Z.tar.gz`` (exactly the installed
   release, else the newest patch of the same X.Y), extracted into a scratch directory;
3. the cache directory (``$MEGASHARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/megashard``, else
   ``~/.cache/megashard``): ``Megatron-LM-core_vX.Y.Z`` left there by an earlier fetch;
4. ``git clone --depth 1 --branch core_vX.Y.Z`` of NVIDIA/Megatron-LM into that cache
   directory, when the network allows (cloned beside it, renamed into place when complete);

and otherwise raises :class:`TreeMissing`, whose message is the one command that fixes it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Tuple

URL = "https://github.com/NVIDIA/Megatron-LM.git"
#: the commit of each tag (NVIDIA/Megatron-LM); `git archive` records it in the tarball's pax header
TAG_COMMITS = {
    "0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
    "0.19.0": "5be9626709af2722333bf54797c954c09edeada3",
}
#: `git archive --prefix=Megatron-LM-<tag>/`: the tag names the megatron-core release
TAG_DIR = re.compile(r"^Megatron-LM-core_v(\d+\.\d+\.\d+)$")
ARCHIVE = re.compile(r"^Megatron-LM-core_v(\d+)\.(\d+)\.(\d+)\.tar\.gz$")


class TreeMissing(RuntimeError):
    """No Megatron-LM tree for the installed release could be found or fetched."""


@dataclass(frozen=True)
class Tree:
    path: str
    source: str  # where it came from, for messages
    commit: Optional[str] = None  # the commit it was made from, when known (archive header, git)


def is_tree(d: str) -> bool:
    return (os.path.isfile(os.path.join(d, "megatron", "training", "checkpointing.py"))
            and os.path.isfile(os.path.join(d, "pretrain_gpt.py")))


def cache_dir(env: Mapping[str, str]) -> Path:
    if env.get("MEGASHARD_CACHE_DIR"):
        return Path(env["MEGASHARD_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megashard"


def clone_command(version: str, dest: Path, url: str = URL) -> str:
    return f"git clone --depth 1 --branch core_v{version} {url} {dest}"


def vendored_archive(vendor: Path, version: str) -> Optional[Path]:
    """The archive for ``version``; else the newest patch release of the same major.minor."""
    want = tuple(int(x) for x in version.split("."))
    best: Optional[Tuple[Tuple[int, ...], Path]] = None
    for p in sorted(vendor.glob("Megatron-LM-core_v*.tar.gz")) if vendor.is_dir() else []:
        m = ARCHIVE.match(p.name)
        if not m:
            continue
        v = tuple(int(x) for x in m.groups())
        if v == want:
            return p
        if v[:2] == want[:2] and (best is None or v > best[0]):
            best = (v, p)
    return best[1] if best else None


def extract(archive: Path, dest: Path) -> Tuple[str, Optional[str]]:
    """Extract a ``git archive`` tarball (regular files and directories only): its top directory and commit."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        bad = [m.name for m in members if not (m.isfile() or m.isdir()) or m.name.startswith("/")
               or ".." in m.name.split("/")]
        if len(tops) != 1 or bad:
            raise TreeMissing(f"{archive}: unexpected layout (tops {sorted(tops)}, refused {bad[:5]})")
        tar.extractall(dest, members=members, filter="data")
        commit = tar.pax_headers.get("comment")
    return str(dest / tops.pop()), commit


def git_fetch(version: str, dest: Path, url: str = URL, timeout: float = 600) -> str:
    """Shallow-clone tag ``core_v<version>`` to ``dest`` (via a sibling temporary directory); its commit."""
    tmp = dest.with_name(dest.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0")
    try:
        p = subprocess.run(["git", "clone", "-q", "--depth", "1", "--branch", f"core_v{version}", url, str(tmp)],
                           capture_output=True, text=True, timeout=timeout, env=env)
        if p.returncode != 0:
            raise TreeMissing(p.stderr.strip() or f"git clone exited with {p.returncode}")
        commit = subprocess.run(["git", "-C", str(tmp), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        os.replace(tmp, dest)
        return commit
    except (OSError, subprocess.SubprocessError) as e:
        raise TreeMissing(f"git clone failed: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def find_tree(version: str, repo: Path, scratch: Callable[[], Path], env: Mapping[str, str] = os.environ,
              url: str = URL, commits: Mapping[str, str] = TAG_COMMITS) -> Tree:
    """The Megatron-LM tree for megatron-core ``version`` (see the module docstring for the order).

    ``scratch()`` gives an empty directory to extract a vendored archive into.
    """
    explicit = env.get("MEGATRON_LM_DIR")
    if explicit:
        if not is_tree(explicit):
            raise TreeMissing(f"MEGATRON_LM_DIR={explicit} is not a Megatron-LM tree (needs "
                              "megatron/training/checkpointing.py and pretrain_gpt.py); unset it to look "
                              "elsewhere")
        return Tree(explicit, f"MEGATRON_LM_DIR={explicit}")
    vendor = repo.parent / "shared" / "vendor"
    archive = vendored_archive(vendor, version)
    if archive is not None:
        path, commit = extract(archive, scratch())
        if not is_tree(path):
            raise TreeMissing(f"{archive} does not hold megatron/training and pretrain_gpt.py")
        return Tree(path, str(archive), commit)
    cached = cache_dir(env) / f"Megatron-LM-core_v{version}"
    if is_tree(str(cached)):
        return Tree(str(cached), f"cache {cached}")
    try:
        commit = git_fetch(version, cached, url)
    except TreeMissing as e:
        raise TreeMissing(
            f"Megatron-LM's training code for megatron-core {version} is missing: not in MEGATRON_LM_DIR, "
            f"not in {vendor}, not in {cached.parent}, and fetching it failed ({e}). Fix: "
            f"{clone_command(version, cached, url)}") from None
    expected = commits.get(version)
    if expected and commit != expected:
        shutil.rmtree(cached, ignore_errors=True)
        raise TreeMissing(f"{url} tag core_v{version} is commit {commit}, expected {expected}")
    return Tree(str(cached), f"git {url} core_v{version}", commit)


def tree_version(path: str) -> Optional[str]:
    """The megatron-core release a Megatron-LM tree belongs to, or None when it cannot be told.

    A full checkout carries ``megatron/core/package_info.py``; the vendored archive (no
    ``megatron/core``) is named after its tag by ``git archive --prefix``.
    """
    info = os.path.join(path, "megatron", "core", "package_info.py")
    if os.path.isfile(info):
        text = open(info).read()
        parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
        return ".".join(p.group(1) for p in parts) if all(parts) else None
    m = TAG_DIR.match(os.path.basename(os.path.normpath(path)))
    return m.group(1) if m else None

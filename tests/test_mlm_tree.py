"""A clone anywhere finds Megatron-LM's training code: MEGATRON_LM_DIR, then ../shared/vendor/, then the
cache directory, then a ``git`` fetch of the matching tag into it; only then a failure naming the one
command that fixes it. (The fetch is exercised against a local repository standing in for GitHub.)"""
from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from megatron_helpers.mlm_tree import TreeMissing, find_tree, tree_version, vendored_archive

FILES = {"megatron/training/checkpointing.py": "# training\n", "pretrain_gpt.py": "# script\n"}


def _tree(d: Path) -> Path:
    for name, text in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


def _archive(vendor: Path, version: str, commit: str = "c0ffee") -> Path:
    vendor.mkdir(parents=True, exist_ok=True)
    path = vendor / f"Megatron-LM-core_v{version}.tar.gz"
    with tarfile.open(path, "w:gz", pax_headers={"comment": commit}) as tar:
        for name, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"Megatron-LM-core_v{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin",
                               "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd)}).stdout.strip()


@pytest.fixture
def layout(tmp_path: Path):
    """A clone at tmp/clone/megashard with nothing beside it; scratch and cache directories."""
    repo = tmp_path / "clone" / "megashard"
    repo.mkdir(parents=True)
    scratch = tmp_path / "scratch"
    return repo, (lambda: scratch.mkdir() or scratch), {"MEGASHARD_CACHE_DIR": str(tmp_path / "cache")}


def test_megatron_lm_dir_comes_first(layout, tmp_path):
    repo, scratch, env = layout
    _archive(repo.parent / "shared" / "vendor", "0.19.0")
    mine = _tree(tmp_path / "mine")
    tree = find_tree("0.19.0", repo, scratch, {**env, "MEGATRON_LM_DIR": str(mine)})
    assert tree.path == str(mine) and tree.source == f"MEGATRON_LM_DIR={mine}"
    with pytest.raises(TreeMissing, match="is not a Megatron-LM tree"):
        find_tree("0.19.0", repo, scratch, {**env, "MEGATRON_LM_DIR": str(tmp_path)})


def test_vendored_archive_of_the_release_then_of_its_minor(layout):
    repo, scratch, env = layout
    vendor = repo.parent / "shared" / "vendor"
    _archive(vendor, "0.16.1")
    exact = _archive(vendor, "0.19.0", commit="abc")
    tree = find_tree("0.19.0", repo, scratch, env)
    assert tree.source == str(exact) and tree.commit == "abc" and tree_version(tree.path) == "0.19.0"
    assert (Path(tree.path) / "pretrain_gpt.py").read_text() == "# script\n"
    assert vendored_archive(vendor, "0.19.2") == exact  # a patch release uses its minor's archive
    assert vendored_archive(vendor, "0.18.0") is None


def _tagged_remote(path: Path) -> Path:
    """A local git repository holding a Megatron-LM-like tree, tagged core_v0.19.0 (stands in for GitHub)."""
    remote = _tree(path)
    _git("init", "-q", cwd=remote)
    _git("add", "-A", cwd=remote)
    _git("commit", "-qm", "x", cwd=remote)
    _git("tag", "core_v0.19.0", cwd=remote)
    return remote


def test_cache_directory_then_git_fetch_of_the_tag(layout, tmp_path):
    repo, scratch, env = layout
    remote = _tagged_remote(tmp_path / "remote")
    head = _git("rev-parse", "HEAD", cwd=remote)

    tree = find_tree("0.19.0", repo, scratch, env, url=f"file://{remote}", commits={"0.19.0": head})
    cached = Path(env["MEGASHARD_CACHE_DIR"]) / "Megatron-LM-core_v0.19.0"
    assert tree.path == str(cached) and tree.commit == head and tree_version(tree.path) == "0.19.0"
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name]  # no partial clone left
    # the next session finds it in the cache, without the network
    again = find_tree("0.19.0", repo, scratch, env, url="file:///nonexistent")
    assert again.path == str(cached) and again.source == f"cache {cached}"


def test_a_tag_at_another_commit_is_refused_and_not_cached(layout, tmp_path):
    repo, scratch, env = layout
    remote = _tagged_remote(tmp_path / "remote")
    with pytest.raises(TreeMissing, match="expected 5be9626709af2722333bf54797c954c09edeada3"):
        find_tree("0.19.0", repo, scratch, env, url=f"file://{remote}")
    assert not (Path(env["MEGASHARD_CACHE_DIR"]) / "Megatron-LM-core_v0.19.0").exists()


def test_nothing_found_fails_with_the_one_command_that_fixes_it(layout):
    repo, scratch, env = layout
    with pytest.raises(TreeMissing) as e:
        find_tree("0.19.0", repo, scratch, env, url="file:///nonexistent/Megatron-LM.git")
    cached = Path(env["MEGASHARD_CACHE_DIR"]) / "Megatron-LM-core_v0.19.0"
    msg = str(e.value)
    assert "training code for megatron-core 0.19.0 is missing" in msg
    assert msg.endswith(f"Fix: git clone --depth 1 --branch core_v0.19.0 file:///nonexistent/Megatron-LM.git {cached}")
    assert not cached.exists() and not list(cached.parent.glob("*.partial-*"))

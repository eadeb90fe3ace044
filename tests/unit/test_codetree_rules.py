"""What a sync copies: .gitignore files as git reads them, .fabtrainignore, and what is left out."""

import os
from pathlib import Path

import pytest

from orchestrator.config import codetree
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError


def write(root: Path, rel: str, data: bytes | str = "x") -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        p.write_text(data)
    else:
        p.write_bytes(data)


def tree(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    write(root, ".gitignore", "data/\n*.log\n!keep.log\nwandb\n/outputs/\n")
    write(root, "train.py", "print(1)\n")
    write(root, "data/big.bin", b"\0" * 5000)
    write(root, "data/sub/more.bin", b"\0" * 3000)
    write(root, "run.log", "l" * 10)
    write(root, "keep.log", "k")
    write(root, "wandb/run-1/files.txt", "w" * 100)
    write(root, "outputs/o.txt", "o" * 20)
    write(root, "pkg/outputs/kept.txt", "anchored /outputs/ is the root's only")
    write(root, "pkg/.gitignore", "*.csv\n!pkg-keep.csv\n")
    write(root, "pkg/a.csv", "a")
    write(root, "pkg/pkg-keep.csv", "b")
    write(root, "other/a.csv", "not under pkg: its rules do not apply")
    write(root, ".git/HEAD", "ref")
    return root


def test_gitignore_files_nested_and_negated_as_git_reads_them(tmp_path):
    root = tree(tmp_path)
    assert codetree.files(root) == [
        "./.gitignore",
        "./keep.log",
        "./other/a.csv",
        "./pkg/.gitignore",
        "./pkg/outputs/kept.txt",
        "./pkg/pkg-keep.csv",
        "./train.py",
    ]


def test_what_was_left_out_is_counted_and_the_biggest_named(tmp_path):
    root = tree(tmp_path)
    sel = codetree.select(root)
    assert (sel.left_files, sel.left_bytes) == (6, 5000 + 3000 + 10 + 100 + 20 + 1)
    assert sel.left_top[:3] == (("data/", 8000), ("wandb/", 100), ("outputs/", 20))
    assert sel.bytes == sum((root / f[2:]).stat().st_size for f in sel.files)
    assert not sel.partial
    info = codetree.summary(sel, root)
    assert info == [
        ("info", f"code: 7 files, {codetree.size_text(sel.bytes)} from {root}"),
        (
            "info",
            "left out by .gitignore/.fabtrainignore: 6 files, 8.1 kB (data/ 8.0 kB, wandb/ 100 B, "
            "outputs/ 20 B)",
        ),
    ]


def test_fabtrainignore_at_the_root_comes_after_the_gitignore(tmp_path):
    root = tree(tmp_path)
    write(root, ".fabtrainignore", "other/\n!data/\n")
    got = codetree.files(root)
    assert "./other/a.csv" not in got
    assert "./data/big.bin" in got and "./data/sub/more.bin" in got  # re-included by the later file
    write(root, "pkg/.fabtrainignore", "*\n")  # read at the root only
    assert "./pkg/pkg-keep.csv" in codetree.files(root)


def test_a_directory_left_out_is_not_looked_into(tmp_path):
    root = tmp_path / "p"
    write(root, ".gitignore", "build/\n!build/keep.txt\n")
    write(root, "build/keep.txt", "git cannot re-include a file under a left-out folder")
    write(root, "build/.gitignore", "!*\n")
    write(root, "a.py")
    assert codetree.files(root) == ["./.gitignore", "./a.py"]


def test_the_budget_for_counting_left_out_folders(tmp_path, monkeypatch):
    root = tmp_path / "p"
    write(root, ".gitignore", "data/\n")
    for i in range(20):
        write(root, f"data/{i}.bin", b"1")
    monkeypatch.setattr(codetree, "LEFT_COUNT_MAX", 5)
    sel = codetree.select(root)
    assert sel.partial and sel.left_files == 5
    assert "(at least: counting stopped)" in codetree.summary(sel, root)[1][1]


def test_a_large_tree_is_warned_about_naming_its_biggest_folder(tmp_path, monkeypatch):
    root = tmp_path / "p"
    write(root, "data/x.bin", b"\0" * 3000)
    write(root, "main.py", "m")
    monkeypatch.setattr(codetree, "WARN_BYTES", 2000)
    level, text = codetree.summary(codetree.select(root), root)[-1]
    assert level == "warning"
    assert text == (
        "3.0 kB of code to sync (biggest: data/ 3.0 kB, main.py 1 B): a data folder? "
        "list it in .gitignore or .fabtrainignore"
    )


def test_excludes_stay_and_links_are_listed_but_not_keyed(tmp_path):
    root = tmp_path / "p"
    write(root, "main.py")
    write(root, ".venv/lib/x.py")
    write(root, "pkg/__pycache__/m.pyc")
    os.symlink("main.py", root / "alias.py")
    sel = codetree.select(root)
    assert sel.files == ("./main.py",) and sel.links == ("./alias.py",)
    assert (sel.left_files, sel.left_top) == (0, ())  # EXCLUDES are not counted as left out
    listed = codetree.list_file(root).read_bytes()
    assert listed == b"./alias.py\0./main.py\0"


def test_the_list_file_is_named_by_its_content_and_rsync_gets_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tree(tmp_path)
    path = codetree.list_file(root)
    assert path.parent == tmp_path / "cache" / "fabtrain" / "code-lists"
    assert path.read_bytes().split(b"\0")[:-1] == [f.encode() for f in codetree.files(root)]
    assert codetree.list_file(root) == path
    assert codetree.rsync_filters("", root)[-2:] == ["--from0", f"--files-from={path}"]
    write(root, "new.py")
    assert codetree.list_file(root) != path
    assert codetree.rsync_filters() == [f"--exclude={p}" for p in codetree.EXCLUDES]


def test_the_builtin_trainers_keep_their_folder_and_the_project_rules(tmp_path):
    sel = codetree.select(jobspec.PROJECT_ROOT, codetree.BUILTIN_ONLY)
    assert sel.files and all(f.startswith("./trainers/") for f in sel.files)
    assert codetree.list_file(jobspec.PROJECT_ROOT, "trainers").read_bytes().count(b"\0") == len(sel.files)


def test_an_unreadable_ignore_file_is_named(tmp_path):
    if os.getuid() == 0:
        pytest.skip("root reads every file")
    root = tmp_path / "p"
    write(root, ".gitignore", "x\n")
    (root / ".gitignore").chmod(0)
    with pytest.raises(UserError, match=r"\.gitignore: cannot read this ignore file"):
        codetree.select(root)


def test_sizes_for_a_person():
    assert [codetree.size_text(n) for n in (0, 999, 1000, 52_428_800, 3 * 10**9, 5 * 10**12)] == [
        "0 B",
        "999 B",
        "1.0 kB",
        "52.4 MB",
        "3.0 GB",
        "5000.0 GB",
    ]


def test_a_plan_walks_the_tree_once_for_all_its_hosts(tmp_path, monkeypatch):
    root = tmp_path / "p"
    write(root, "a.py")
    walks = []
    real = codetree.list_file
    monkeypatch.setattr(codetree, "list_file", lambda *a: walks.append(a) or real(*a))
    first = [codetree.rsync_filters("", root) for _ in range(64)]
    assert len(walks) == 1 and all(f == first[0] for f in first)
    monkeypatch.setattr(codetree, "LIST_REUSE", 0.0)  # later (an attempt after a teardown): walked again
    write(root, "b.py")
    assert codetree.rsync_filters("", root) != first[0] and len(walks) == 2

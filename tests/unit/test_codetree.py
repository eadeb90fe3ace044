"""A job's code on the hosts: keyed by what it holds, linked into a writable working directory."""

import importlib.util
import os
import time
from pathlib import Path

from orchestrator.config import codetree
from orchestrator.core import jobspec

ROOT = Path(__file__).resolve().parents[2]


def entrypoint():
    spec = importlib.util.spec_from_file_location("entrypoint", ROOT / "docker" / "entrypoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def project(tmp_path: Path) -> Path:
    p = tmp_path / "proj"
    (p / "conf").mkdir(parents=True)
    (p / "main.py").write_text("print('hi')\n")
    (p / "conf" / "config.yaml").write_text("lr: 1\n")
    (p / ".git").mkdir()
    (p / ".git" / "HEAD").write_text("ref\n")
    (p / "__pycache__").mkdir()
    (p / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"\0")
    return p


def test_the_key_names_the_files_rsync_copies(tmp_path):
    p = project(tmp_path)
    assert codetree.files(p) == ["./conf/config.yaml", "./main.py"]
    k = codetree.key(p)
    assert len(k) == 16 and k == codetree.key(p)
    (p / ".git" / "HEAD").write_text("other\n")  # not synced: same key
    assert codetree.key(p) == k
    (p / "main.py").write_text("print('edited')\n")
    os.utime(p / "main.py", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert codetree.key(p) != k  # edited: a new directory on the hosts, the old one untouched


def test_no_local_clusters_state_is_synced_whatever_its_number(tmp_path):
    """.cluster holds the local cluster's private key, .cluster2 the second cluster's (the suite's
    second worker): neither is copied, even from a tree with no .gitignore."""
    p = project(tmp_path)
    for d in (".cluster", ".cluster2"):
        (p / d).mkdir()
        (p / d / "id_ed25519").write_text("PRIVATE\n")
    assert codetree.files(p) == ["./conf/config.yaml", "./main.py"]


def test_this_project_sends_only_its_trainers():
    files = codetree.files(jobspec.PROJECT_ROOT, codetree.BUILTIN_ONLY)
    assert files and all(f.startswith("./trainers/") for f in files)
    assert "./trainers/gpt.py" in files
    assert codetree.rsync_filters("trainers")[-2:] == ["--include=/trainers/***", "--exclude=*"]
    assert codetree.key(jobspec.PROJECT_ROOT, "trainers") != codetree.key(jobspec.PROJECT_ROOT)


def test_the_working_directory_links_the_code_and_keeps_what_the_program_wrote(tmp_path, monkeypatch):
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "main.py").write_text("main\n")
    (code / "pkg" / "mod.py").write_text("mod\n")
    (code / "checkpoints").mkdir()
    (code / "checkpoints" / ".keep").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    ep = entrypoint()
    ep.link_code({"FABTRAIN_CODE": str(code)})
    assert os.readlink(work / "main.py") == str(code / "main.py")
    assert (work / "pkg" / "mod.py").read_text() == "mod\n" and not (work / "pkg").is_symlink()
    # A relative write lands in the working directory, also inside a directory the code has.
    (work / "checkpoints" / "ckpt.pt").write_bytes(b"state")
    (work / "outputs").mkdir()
    (work / "outputs" / "log.txt").write_text("x")
    # The next attempt's code lost pkg/mod.py: its link goes; the program's files stay.
    (code / "pkg" / "mod.py").unlink()
    (code / "new.py").write_text("new\n")
    ep.link_code({"FABTRAIN_CODE": str(code)})
    assert not os.path.lexists(work / "pkg" / "mod.py")
    assert (work / "new.py").read_text() == "new\n"
    assert (work / "checkpoints" / "ckpt.pt").read_bytes() == b"state"
    assert (work / "outputs" / "log.txt").read_text() == "x"
    ep.link_code({})  # no code mount (a platform that puts the code in the image): nothing happens

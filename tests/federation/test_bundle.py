"""Code bundles: deterministic archives, and every archive a site refuses before writing a file."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from fedweave.federation import bundle
from fedweave.federation.bundle import BundleError, digest, modules, pack, unpack


def code(folder: Path) -> Path:
    (folder / "mine").mkdir(parents=True)
    (folder / "mine" / "__init__.py").write_text("")
    (folder / "mine" / "algo.py").write_text("class Algo:\n    pass\n")
    (folder / "helpers.py").write_text("X = 1\n")
    (folder / "weights.json").write_text("{}")
    (folder / "mine" / "__pycache__").mkdir()
    (folder / "mine" / "__pycache__" / "algo.cpython-311.pyc").write_bytes(b"\0")
    return folder


def tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def member(name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


def test_pack_is_deterministic(tmp_path: Path):
    a = pack(code(tmp_path / "a"))
    assert pack(tmp_path / "a") == a
    b = code(tmp_path / "b")  # the same files made later, other mtimes and modes
    for path in b.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    (b / "helpers.py").chmod(0o755)
    assert digest(pack(b)) == digest(a) == __import__("hashlib").sha256(a).hexdigest()
    (b / "helpers.py").write_text("X = 2\n")
    assert digest(pack(b)) != digest(a)


def test_pack_holds_sorted_plain_files_without_caches(tmp_path: Path):
    data = pack(code(tmp_path / "a"))
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        infos = archive.getmembers()
    assert [i.name for i in infos] == ["helpers.py", "mine/__init__.py", "mine/algo.py", "weights.json"]
    assert {(i.mtime, i.uid, i.gid, i.mode, i.uname) for i in infos} == {(0, 0, 0, 0o644, "")}


def test_pack_refuses_symlinks_and_limits(tmp_path: Path, monkeypatch):
    folder = code(tmp_path / "a")
    (folder / "link.py").symlink_to(folder / "helpers.py")
    with pytest.raises(BundleError, match="symbolic link"):
        pack(folder)
    (folder / "link.py").unlink()
    (folder / "sub").symlink_to(folder / "mine")
    with pytest.raises(BundleError, match="symbolic link"):
        pack(folder)
    (folder / "sub").unlink()
    monkeypatch.setattr(bundle, "MAX_FILES", 3)
    with pytest.raises(BundleError, match="4 files, more than 3"):
        pack(folder)
    monkeypatch.setattr(bundle, "MAX_FILES", 100)
    monkeypatch.setattr(bundle, "MAX_BYTES", 10)
    with pytest.raises(BundleError, match="more than 10"):
        pack(folder)


def test_unpack_round_trip(tmp_path: Path):
    data = pack(code(tmp_path / "a"))
    out = unpack(data, digest(data), tmp_path / "jobs" / "j1" / "code")
    assert out == tmp_path / "jobs" / "j1" / "code"
    assert (out / "mine" / "algo.py").read_text() == "class Algo:\n    pass\n"
    assert sorted(p.name for p in (tmp_path / "jobs" / "j1").iterdir()) == ["code"]  # no staging left
    assert modules(out) == ["helpers", "mine"]
    assert pack(out) == data


def test_unpack_checks_the_hash_before_opening(tmp_path: Path):
    not_a_tar = b"this is not an archive"
    with pytest.raises(BundleError, match="is not the submitted"):
        unpack(not_a_tar, "0" * 64, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(BundleError, match="not a readable archive"):
        unpack(not_a_tar, digest(not_a_tar), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([member("../evil.py")], "leaves the bundle's folder"),
        ([member("a/../../evil.py")], "leaves the bundle's folder"),
        ([member("/etc/evil.py")], "absolute path"),
        ([member("link.py", kind=tarfile.SYMTYPE, link="/etc/passwd")], "is a link"),
        ([member("hard.py", kind=tarfile.LNKTYPE, link="a.py")], "is a link"),
        ([member("dev", kind=tarfile.CHRTYPE)], "not a regular file"),
        ([member("fifo", kind=tarfile.FIFOTYPE)], "not a regular file"),
        ([member("folder", kind=tarfile.DIRTYPE)], "not a regular file"),
        ([member("a.py"), member("a.py")], "appears twice"),
    ],
)
def test_unpack_refuses_unsafe_members(tmp_path: Path, members, message):
    data = tar(*members)
    with pytest.raises(BundleError, match=message):
        unpack(data, digest(data), tmp_path / "out")
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "evil.py").exists()


def test_unpack_refuses_too_many_or_too_large(tmp_path: Path, monkeypatch):
    many = tar(*(member(f"f{i}.py") for i in range(4)))
    monkeypatch.setattr(bundle, "MAX_FILES", 3)
    with pytest.raises(BundleError, match="more than 3 files"):
        unpack(many, digest(many), tmp_path / "out")
    monkeypatch.setattr(bundle, "MAX_FILES", 100)
    large = tar(member("big.bin", b"x" * 5000))
    monkeypatch.setattr(bundle, "MAX_BYTES", 4096)
    with pytest.raises(BundleError, match="more than 4096 bytes"):
        unpack(large, digest(large), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_unpack_never_replaces_a_folder(tmp_path: Path):
    data = tar(member("a.py"))
    (tmp_path / "out").mkdir()
    with pytest.raises(BundleError, match="exists already"):
        unpack(data, digest(data), tmp_path / "out")

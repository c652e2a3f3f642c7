"""Code bundles: a job's own modules shipped to the sites as a content-addressed archive.

:func:`pack` makes a deterministic tar of a folder's regular files (names sorted; mtime, owner and
group zeroed; mode 0644), so the same folder always gives the same bytes and the same
:func:`digest`. A site's :func:`unpack` checks the digest *before* it opens the archive, then
refuses anything but plain relative files within the limits, writes into a temporary folder and
renames it into place. Nothing in a bundle is executed here: the folder returned goes on the
client's ``PYTHONPATH``, and only a policy that allows the digest lets the job import it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import io
import os
import shutil
import stat
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

MAX_BYTES = 64 * 2**20
"""The most bytes a bundle's files hold together (and its archive may be)."""

MAX_FILES = 2000
"""The most files a bundle holds."""

SKIPPED = ("__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache")
"""Folders :func:`pack` leaves out (caches and version control)."""


class BundleError(ValueError):
    """A bundle is refused: a hash mismatch, an unsafe member, or over a limit (one line)."""


def digest(data: bytes) -> str:
    """The sha256 of ``data`` in lowercase hex: a bundle's name."""
    return hashlib.sha256(data).hexdigest()


STARTUP_MODULES = ("sitecustomize", "usercustomize")
"""Modules Python imports from its path when it starts, before any job code is named."""


@functools.cache
def installed_modules() -> frozenset[str]:
    """The top-level modules a bundle may not name: the standard library's, every installed distribution's,
    and those Python imports when it starts (:data:`STARTUP_MODULES`)."""
    return (frozenset(sys.stdlib_module_names) | frozenset(importlib.metadata.packages_distributions())
            | frozenset(STARTUP_MODULES))


def _shadowing(name: PurePosixPath) -> str | None:
    """The installed module that the bundle file ``name`` would be imported in place of, or None: the
    bundle's folder comes first on the client's ``PYTHONPATH``, before the standard library and site-packages."""
    top = name.parts[0]
    if len(name.parts) == 1:  # a file: a module when Python imports its suffix (.py, .pyc, .so, ...)
        suffixes = [s for s in importlib.machinery.all_suffixes() if top.endswith(s)]
        if not suffixes:
            return None
        top = top[: -len(suffixes[0])].partition(".")[0]
    return top if top in installed_modules() else None


def _check_shadowing(name: PurePosixPath, shown: str) -> None:
    module = _shadowing(name)
    if module in STARTUP_MODULES:
        raise BundleError(f"bundle member {shown!r} is {module!r}, which Python runs when it starts, before any job code")
    if module is not None:
        raise BundleError(
            f"bundle member {shown!r} would be imported in place of the installed module {module!r} (a bundle "
            "comes first on the client's PYTHONPATH); rename it"
        )


def _files(directory: Path) -> list[tuple[str, Path]]:
    """``(archive name, path)`` of every regular file under ``directory``, sorted by name."""
    found = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in dirs:
            if (Path(root) / name).is_symlink():
                raise BundleError(f"bundle {directory}: {Path(root, name)} is a symbolic link; a bundle holds files only")
        dirs[:] = [d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info")]
        for name in files:
            path = Path(root) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise BundleError(f"bundle {directory}: {path} is a symbolic link; a bundle holds files only")
            if not stat.S_ISREG(mode):
                raise BundleError(f"bundle {directory}: {path} is not a regular file")
            if name.endswith((".pyc", ".pyo")):
                continue
            found.append((path.relative_to(directory).as_posix(), path))
    return sorted(found)


def pack(directory: Path) -> bytes:
    """The deterministic archive of ``directory``'s files (see the module's text); a BundleError when it
    holds a link or a special file, or more than :data:`MAX_FILES` files or :data:`MAX_BYTES` bytes."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BundleError(f"bundle {directory}: not a folder")
    files = _files(directory)
    for name, _ in files:
        _check_shadowing(PurePosixPath(name), name)
    if len(files) > MAX_FILES:
        raise BundleError(f"bundle {directory}: {len(files)} files, more than {MAX_FILES}")
    total = sum(path.stat().st_size for _, path in files)
    if total > MAX_BYTES:
        raise BundleError(f"bundle {directory}: {total} bytes of files, more than {MAX_BYTES}")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _member_name(member: tarfile.TarInfo) -> PurePosixPath:
    """The checked relative name of ``member``: a regular file, not absolute, no ``..``, no control
    characters (a NUL ends a name in the system's calls), a name of a file (not ``.``)."""
    name = PurePosixPath(member.name)
    if not member.isreg():
        kind = "a link" if member.issym() or member.islnk() else "not a regular file"
        raise BundleError(f"bundle member {member.name!r} is {kind}; a bundle holds files only")
    if not name.parts or any(ord(c) < 32 or c == "\x7f" for c in member.name):
        raise BundleError(f"bundle member {member.name!r} is not a plain name of a file")
    if name.is_absolute() or member.name.startswith(("/", "\\")) or ":" in name.parts[0]:
        raise BundleError(f"bundle member {member.name!r} is an absolute path")
    if any(part in ("..", "") for part in member.name.replace("\\", "/").split("/")) or "\\" in member.name:
        raise BundleError(f"bundle member {member.name!r} leaves the bundle's folder (..) or is not a plain name")
    return name


def unpack(data: bytes, expected_sha256: str, dest: Path) -> Path:
    """Check ``data`` against ``expected_sha256``, then write its files into ``dest`` (which must not
    exist yet) and return it: the folder to put on the client's ``PYTHONPATH``. Refuses a mismatch,
    absolute names, ``..``, links, devices, more than :data:`MAX_FILES` files or :data:`MAX_BYTES` bytes."""
    if len(data) > MAX_BYTES + 2**20:
        raise BundleError(f"bundle: {len(data)} bytes, more than {MAX_BYTES}")
    found = digest(data)
    if found != expected_sha256:
        raise BundleError(f"bundle: sha256 {found} is not the submitted {expected_sha256}")
    dest = Path(dest)
    if os.path.lexists(dest):  # a link too, even one to nothing
        raise BundleError(f"bundle: the folder it unpacks into ({dest.name}) exists already")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            total, seen = 0, set()
            for count, member in enumerate(archive, start=1):
                name = _member_name(member)
                total += member.size
                if count > MAX_FILES:
                    raise BundleError(f"bundle: more than {MAX_FILES} files")
                if total > MAX_BYTES:
                    raise BundleError(f"bundle: more than {MAX_BYTES} bytes of files")
                if name in seen:
                    raise BundleError(f"bundle member {member.name!r} appears twice")
                _check_shadowing(name, member.name)
                seen.add(name)
                source = archive.extractfile(member)
                assert source is not None  # a regular file's
                target = staging.joinpath(*name.parts)
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with open(target, "xb") as out:
                        shutil.copyfileobj(source, out)
                except OSError as exc:  # its message would name the site's folders
                    raise BundleError(
                        f"bundle member {member.name!r} cannot be written ({exc.strerror or type(exc).__name__}): "
                        "a name both a file and a folder's, or too long for the site's file system"
                    ) from None
                target.chmod(0o644)
        os.rename(staging, dest)
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and os.path.lexists(dest):  # another unpack renamed its folder there first
            raise BundleError(f"bundle: the folder it unpacks into ({dest.name}) exists already") from None
        raise BundleError(f"bundle: not a readable archive ({exc})") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def modules(folder: Path) -> list[str]:
    """The top-level modules an unpacked bundle provides: its ``*.py`` files and its folders (packages
    and namespace packages), sorted; what :meth:`fedweave.federation.policy.SitePolicy.check` lets a
    job's ``package.module:Name`` references name."""
    names = {p.stem for p in Path(folder).iterdir() if p.is_file() and p.suffix == ".py"}
    names |= {p.name for p in Path(folder).iterdir() if p.is_dir() and p.name.isidentifier()}
    return sorted(names)

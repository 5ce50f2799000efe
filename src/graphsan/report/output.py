"""Every file graphsan writes (JSON reports, HTML pages, traces, selftest and repro results) is
written whole, through `writing`: a temporary file in the same folder, renamed over the target
when the writer is done. A reader, a crash or a full disk never leaves half a file behind, and
the file that was there stays whole until the new one replaces it.

Only a regular file is ever replaced. A FIFO or a character device (`/dev/null`, `/dev/stdout`,
a terminal, a shell's `>(...)`) is written in place, as a shell's `>` would: nothing is renamed
over it, so the device stays what it was. Anything else that is not a regular file (a block
device, a socket) is refused (`kind_of`).

Every output path is resolved once, when the command starts (`output_path`), in the caller's
directory: a program that changes directory (`os.chdir`, Hydra) does not move where it goes.
`-` names stdout for the options that accept it; `same_output` finds two options that would
write to one file.

    with writing("out.json") as fh:
        json.dump(data, fh)
    write_output("page.html", text)
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import sys
from collections.abc import Iterator
from typing import IO

STDOUT = "-"


def output_path(path: str) -> str:
    """`path` as an absolute path in the current directory (`-` stays stdout): resolved once,
    at start, so that writing it later means the same file whatever the program did."""
    return path if path == STDOUT else os.path.abspath(path)


# what a path can name, by its kind: written in place, or refused
IN_PLACE = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device"}
REFUSED = {stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def kind_of(path: str) -> int | None:
    """The file type (`stat.S_IFMT`) of what `path` names once links are followed; None when
    nothing is there (or it cannot be looked at)."""
    try:
        return stat.S_IFMT(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def target_of(path: str) -> str:
    """The file a path names once links are followed: `-` stays stdout, and two spellings of
    one file give the same string."""
    return path if path == STDOUT else os.path.realpath(path)


def same_output(options: dict[str, str | None]) -> tuple[str, str] | None:
    """The first two options (name -> path; None: not given) that name one file, or None."""
    seen: dict[str, str] = {}
    for option, path in options.items():
        if path is None:
            continue
        target = target_of(path)
        if target in seen:
            return seen[target], option
        seen[target] = option
    return None


@contextlib.contextmanager
def writing(path: str, binary: bool = False) -> Iterator[IO]:
    """A file to write `path`'s new content to; it becomes `path` when the block ends without
    an error, and is removed otherwise. `-` is stdout (left open); a FIFO or a character device
    is written in place; a block device or a socket is refused. Raises OSError."""
    if path == STDOUT:
        out = sys.stdout.buffer if binary else sys.stdout
        yield out
        out.flush()
        return
    kind = kind_of(path)
    if kind in IN_PLACE:
        # opened as it is (no O_CREAT, no rename): the device or FIFO stays what it was
        fd = os.open(path, os.O_WRONLY)
        mode = "wb" if binary else "w"
        with open(fd, mode, **({} if binary else {"encoding": "utf-8"})) as fh:
            yield fh
        return
    if kind is not None and kind != stat.S_IFREG:
        what = REFUSED.get(kind, "not a regular file")
        raise OSError(errno.EINVAL, f"{path} is {what}; expected a regular file")
    target = target_of(path)  # a link keeps pointing at the file it named
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # 0o666 as open() uses, so the umask decides the mode as it does for any new file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with contextlib.suppress(OSError):  # an existing file keeps its mode
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        mode = "wb" if binary else "w"
        with open(fd, mode, **({} if binary else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_output(path: str, data: str | bytes) -> None:
    """Write `data` to `path` whole (`-`: stdout). Raises OSError."""
    with writing(path, binary=isinstance(data, bytes)) as fh:
        fh.write(data)

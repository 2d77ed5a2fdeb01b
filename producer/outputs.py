"""The files spec-collect writes: checked before anything is read, written whole or
not at all (temporary files beside the targets, renamed over them once all are
written and synced; a symlink is written through)."""

from __future__ import annotations

import os
import stat
import tempfile

from producer.errors import OutputError


def check_outputs(out_path: str, errors_path: str | None) -> dict[str, tuple[str, str]]:
    """{option: (path as given, real path to replace)} for -o and --errors. Raises
    OutputError when either cannot be written or both name one file (call it before
    waiting for a batch, to fail at once)."""
    targets = {"-o": (out_path, _target("-o", out_path))}
    if errors_path:
        targets["--errors"] = (errors_path, _target("--errors", errors_path))
        real_out, real_errors = targets["-o"][1], targets["--errors"][1]
        same = real_out == real_errors
        try:
            same = same or os.path.samefile(real_out, real_errors)
        except OSError:
            pass  # one of them does not exist yet: different files
        if same:
            raise OutputError(
                f"-o {out_path} and --errors {errors_path} are the same file: give --errors "
                "another file, or leave it out to write error lines into -o"
            )
    return targets


def _target(option: str, path: str) -> str:
    """The file that writing `path` replaces (a symlink's target, so the link stays)."""
    real = os.path.realpath(path)
    directory = os.path.dirname(real)
    if not os.path.isdir(directory):
        raise OutputError(f"{option} {path}: directory {directory} does not exist")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return real
    except OSError as exc:
        raise OutputError(f"{option} {path}: {exc.strerror}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{option} {path}: is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{option} {path}: not a regular file")
    if not st.st_mode & 0o222 or not os.access(real, os.W_OK):
        raise OutputError(f"{option} {path}: the file is read-only")
    return real


class Outputs:
    """Lines to temporary files beside their targets; every target is replaced only once
    all files are written and synced. On any failure the temporary files are removed
    and the targets are left as they were."""

    def __init__(self, targets: dict[str, tuple[str, str]]):
        self.targets = targets
        self._files: dict[str, tuple[str, object]] = {}  # option -> (temporary path, file)

    def __enter__(self):
        try:
            for option, (shown, real) in self.targets.items():
                self._files[option] = self._open(option, shown, real)
        except BaseException:
            self._discard()
            raise
        return self

    def _open(self, option: str, shown: str, real: str):
        directory = os.path.dirname(real)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".spec-collect-", dir=directory)
        except OSError as exc:
            raise OutputError(
                f"{option} {shown}: cannot create a file in {directory}: {exc.strerror}"
            ) from exc
        try:
            mode = os.stat(real).st_mode & 0o7777
        except OSError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        return tmp, os.fdopen(fd, "wb")

    def write(self, option: str, line: bytes | str) -> None:
        data = line if isinstance(line, bytes) else line.encode()
        try:
            self._files[option][1].write(data + b"\n")
        except OSError as exc:
            raise self._failed(option, exc) from exc

    def _failed(self, option: str, exc: OSError) -> OutputError:
        return OutputError(
            f"{option} {self.targets[option][0]}: cannot write: {exc.strerror}; "
            "the file was left as it was"
        )

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._discard()
            return
        try:
            for option, (_, f) in self._files.items():
                try:
                    f.flush()
                    os.fsync(f.fileno())
                    f.close()
                except OSError as error:
                    raise self._failed(option, error) from error
            for option, (tmp, _) in self._files.items():
                try:
                    os.replace(tmp, self.targets[option][1])
                except OSError as error:
                    raise self._failed(option, error) from error
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        for tmp, f in self._files.values():
            try:
                f.close()
            except OSError:
                pass  # a full disk may refuse the last flush too: the file goes anyway
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

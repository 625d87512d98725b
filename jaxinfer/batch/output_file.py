"""The output file of a batch job: its lock, its settings, and the scan that a resume starts from.

A job owns its output for as long as it runs:
- **Lock.** `OutputLock` holds an exclusive `flock` on the output file itself, so a second job on it
  fails at once, by whatever name (a symlink, a hard link) it reaches the file. `<output>.lock` names
  the holder's pid; it is created by the job, never followed, and removed on release.
- **Settings.** `<output>.meta.json` (beside the output's real path, so symlinks share it) records the settings that decide a line's tokens (the model's
  identity (a hash of its files, cached by size and mtime), dtype, quantization, seeds, sampling defaults, ...). A resume under other settings is
  refused with the differences listed, unless forced.
- **Scan before repair.** `scan_output` reads the whole file (in blocks, keeping only the keys) and changes nothing. Only when every complete
  line is a record does `repair_output` cut off a torn last record (or restore the newline of a whole
  one), so a file that is not jaxinfer's is never touched.

Imports only the standard library and kernels_cpu.build's cache_root (the CLI checks files before jax loads).
"""

import dataclasses
import fcntl
import hashlib
import json
import os
import stat
from pathlib import Path

from jaxinfer.batch.keys import KeyTable

META_FORMAT = "jaxinfer-batch-settings/1"
RECORD_START = b'{"id": '  # every record is written as json.dumps of a dict whose first key is "id"


class ResumeError(ValueError):
    """The existing output cannot be resumed (not a jaxinfer result file, damaged, or other settings)."""


class OutputBusyError(ValueError):
    """Another job holds the output's lock."""


def _real(output: Path) -> Path:
    """The output's own path, symlinks resolved: every name of one output shares its side files."""
    return Path(os.path.realpath(output))


def lock_path(output: Path) -> Path:
    real = _real(output)
    return real.with_name(real.name + ".lock")


def meta_path(output: Path) -> Path:
    real = _real(output)
    return real.with_name(real.name + ".meta.json")


class OutputLock:
    """An exclusive lock on an output file, held from construction until `release()`.

    The lock is an `flock` on the output file itself (created empty when it does not exist yet), so
    every name that reaches it (a symlink, a hard link) shares one lock; it is re-checked after locking
    that the name still leads to the locked file. Beside the output, `<output>.lock` holds the holder's
    pid, for a second job's message. The job creates that note itself (O_EXCL, never following a link)
    and removes it on release. A note left by a killed job is replaced; a link, a directory, a file with
    more than one name or of another owner there is refused, never followed or truncated.
    """

    def __init__(self, output: Path):
        self.output, self.path = Path(output), lock_path(output)
        self.created = False  # whether this job created the output (release may then remove it, if empty)
        self._note_fd: int | None = None
        self._fd: int | None = self._lock_output()
        try:
            self._note_fd = self._write_note()
        except BaseException:
            self.release(keep_output=False)
            raise

    def _lock_output(self) -> int:
        while True:
            fd, created = _open_output(self.output)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputBusyError(
                    f"{self.output} is in use by another jaxinfer job (pid {self._holder()}); wait for it to finish, or write to another --output"
                ) from None
            if _same_file(self.output, fd):
                self.created = created
                return fd
            os.close(fd)  # replaced between the open and the lock: lock the file the name leads to now

    def _holder(self) -> str:
        """The pid the holder's note names ('unknown' when it took the output through a hard link's name)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return "unknown"
        try:
            return os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
        except OSError:
            return "unknown"
        finally:
            os.close(fd)

    def _write_note(self) -> int:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                self._remove_stale_note()
                continue
            except OSError as e:
                raise ValueError(f"cannot create the lock file {self.path}: {e.strerror}") from None
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        raise ValueError(f"cannot create the lock file {self.path}: it keeps reappearing")

    def _remove_stale_note(self) -> None:
        """Remove the note a killed job left (this job holds the output's lock, so no running job owns
        it); refuse anything else there, untouched."""
        st, name = os.lstat(self.path), self.path.name
        why = None
        if stat.S_ISLNK(st.st_mode):
            why = "is a symlink (a lock file is never followed)"
        elif stat.S_ISDIR(st.st_mode):
            why = "is a directory, not a lock file"
        elif not stat.S_ISREG(st.st_mode):
            why = "is not a regular file"
        elif st.st_nlink > 1:
            why = f"is a hard link ({st.st_nlink} names for one file; a lock file has one)"
        elif st.st_uid != os.geteuid():
            why = f"belongs to another user (uid {st.st_uid})"
        if why is not None:
            raise ValueError(f"{name} {why}; remove {self.path} and run again")
        os.unlink(self.path)

    def release(self, *, keep_output: bool = True) -> None:
        """Remove the note, then unlock (idempotent). `keep_output=False`: an output this job created
        and left empty is removed too (a job refused before it ran leaves nothing behind)."""
        if self._note_fd is not None:
            if _same_file(self.path, self._note_fd, follow=False):
                os.unlink(self.path)
            os.close(self._note_fd)
            self._note_fd = None
        if self._fd is None:
            return
        if not keep_output and self.created and os.fstat(self._fd).st_size == 0 and _same_file(self.output, self._fd):
            os.unlink(self.output)
        os.close(self._fd)
        self._fd = None


def _open_output(output: Path) -> tuple[int, bool]:
    """(a descriptor of the output, whether this call created it)."""
    try:
        try:
            return os.open(output, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            return os.open(output, os.O_RDWR), False
    except IsADirectoryError:
        raise ValueError(f"--output {output} is a directory; results (and --resume) need a regular file") from None
    except OSError as e:
        raise ValueError(f"--output {output} cannot be opened: {e.strerror}") from None


def _same_file(path: Path, fd: int, *, follow: bool = True) -> bool:
    try:
        st = os.stat(path, follow_symlinks=follow)
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


_LONGEST_SUFFIX = ".meta.json.4194304.tmp"  # the settings file's temporary name, with the largest pid


def check_side_file_names(output: Path) -> None:
    """Refuse an output whose lock and settings files' names would be too long for its file system."""
    real = _real(output)
    try:
        name_max = os.pathconf(real.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    longest = len(os.fsencode(real.name + _LONGEST_SUFFIX))
    if longest > name_max:
        raise ValueError(
            f"--output {output}: its name is too long for the job's side files ({real.name}{_LONGEST_SUFFIX} would be {longest} bytes, "
            f"the file system allows {name_max}); use a name at most {name_max - len(_LONGEST_SUFFIX)} bytes long"
        )


def check_settings_path(output: Path) -> None:
    """Refuse, before the model loads, side-file names that are too long and a settings path that
    cannot be a settings file."""
    check_side_file_names(output)
    path = meta_path(output)
    if path.is_dir():
        raise ValueError(f"{path.name} is a directory, not a settings file; remove {path} and run again")


# ---------------------------------------------------------------- settings


_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # a Hugging Face folder's weight files
_HASH_BLOCK = 1 << 22
_HASH_CACHE_NAME = "model_hashes.json"


def model_identity(path: Path | None, *, cache: Path | None = None) -> dict:
    """What names a model across runs: its name, its size and a sha256 of its whole files (tensor data
    included; a Hugging Face folder: its config.json and every weight file, by name). Each file is read
    once: its hash is cached by path, size and mtime in `cache` (default: <cache root>/model_hashes.json)."""
    if path is None:
        return {"name": None}
    path = Path(path)
    cache = _default_hash_cache() if cache is None else Path(cache)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and (p.name == "config.json" or p.name.endswith(_MODEL_FILE_SUFFIXES)))
        digest = hashlib.sha256()
        for file in files:
            digest.update(f"{file.name}\0{_file_sha256(file, cache)}\n".encode())
        return {"name": path.name, "bytes": sum(p.stat().st_size for p in files), "sha256": digest.hexdigest()}
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": _file_sha256(path, cache)}


def _default_hash_cache() -> Path:
    from kernels_cpu.build import cache_root  # the one rule for jaxinfer's cache folder (standard library only)

    return cache_root() / _HASH_CACHE_NAME


def _file_sha256(path: Path, cache: Path) -> str:
    """The file's sha256, from the cache when its size and mtime are those it was hashed at."""
    st, key = path.stat(), os.path.realpath(path)
    entries = _read_hash_cache(cache)
    entry = entries.get(key)
    if isinstance(entry, dict) and entry.get("bytes") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    entries[key] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}
    _write_hash_cache(cache, entries)
    return entries[key]["sha256"]


def _read_hash_cache(cache: Path) -> dict:
    try:
        entries = json.loads(cache.read_text("utf-8"))
    except (OSError, ValueError):  # missing, unreadable or damaged: hash again
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_hash_cache(cache: Path, entries: dict) -> None:
    """Best effort, atomically: a cache that cannot be written only means hashing again next time."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, sort_keys=True), "utf-8")
        os.replace(tmp, cache)
    except OSError:
        pass


def read_settings(output: Path) -> dict | None:
    """The settings recorded for an output, or None when it has none."""
    path = meta_path(output)
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ResumeError(f"cannot resume: {path} is damaged (not JSON); use --force-settings to resume anyway") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or not isinstance(meta.get("settings"), dict):
        raise ResumeError(f"cannot resume: {path} is not a jaxinfer settings file; use --force-settings to resume anyway")
    return meta["settings"]


def write_settings(output: Path, settings: dict) -> None:
    """Write the settings atomically (a kill leaves the old file or the new one, never half of one)."""
    path = meta_path(output)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"format": META_FORMAT, "settings": settings}, indent=1, sort_keys=True) + "\n", "utf-8")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: no temporary file is left beside the output
        tmp.unlink(missing_ok=True)
        raise


def settings_differences(recorded: dict, current: dict) -> list[str]:
    """'name: recorded -> now' for each setting that differs, in name order."""
    names = sorted(set(recorded) | set(current))
    missing = "(not set)"
    return [f"{n}: {json.dumps(recorded.get(n, missing))} -> {json.dumps(current.get(n, missing))}" for n in names if recorded.get(n, missing) != current.get(n, missing)]


RESOLVED = "resolved"  # the settings entry of what "auto" resolved to; known only once the model has loaded


def check_resolved(output: Path, resolved: dict) -> None:
    """Refuse a resume whose engine resolved "auto" otherwise (compute dtype, attention, matmul, weight
    formats) than the one its records were made under: the same flags, other numerics."""
    recorded = (read_settings(output) or {}).get(RESOLVED)
    if recorded is not None and (differences := settings_differences(recorded, json.loads(json.dumps(resolved)))):
        raise ResumeError(f"cannot resume: {output} was written by an engine that resolved otherwise ({'; '.join(differences)}); "
                          "pin --dtype, --attention and --matmul to the recorded values, or pass --force-settings to resume anyway")


def check_settings(output: Path, current: dict, *, has_records: bool) -> None:
    """Refuse a resume whose settings differ from those its records were made under (what the engine
    resolved is checked once it has loaded: `check_resolved`)."""
    recorded = read_settings(output)
    if recorded is None:
        if has_records:
            raise ResumeError(
                f"cannot resume: {output} has records but no settings file ({meta_path(output).name}; written by an older "
                "jaxinfer, or removed), so its settings cannot be checked; pass --force-settings to resume anyway"
            )
        return
    differences = settings_differences({k: v for k, v in recorded.items() if k != RESOLVED}, current)
    if differences:
        listed = "; ".join(differences)
        raise ResumeError(f"cannot resume: {output} was written under other settings ({listed}); rerun with the same settings, or pass --force-settings to resume anyway")


# ---------------------------------------------------------------- scan and repair


@dataclasses.dataclass(frozen=True)
class OutputScan:
    """What a resume found in an output, before any change: the keys done and the repair it needs."""

    keys: KeyTable
    size: int  # bytes of the file when scanned
    keep_bytes: int  # bytes to keep: size, or less to cut a torn last record
    add_newline: bool  # the last record is whole but lacks its newline
    num_records: int = 0  # the records kept, a key written twice counted twice (whatif skips this many of a resumed run's output)

    @property
    def needs_repair(self) -> bool:
        return self.keep_bytes != self.size or self.add_newline


def scan_output(path: Path, iter_lines) -> OutputScan:
    """Read an output and check every line is a record; raises ResumeError naming the first that is not.

    A last line without its newline is whole if it parses as a record (its newline is restored), torn if
    it is the start of one (cut off). Anything else there is not a record, and an error, like any other
    line. `iter_lines` is the job's line splitter (blocks of bytes -> numbered lines), so records are
    split as inputs are. The file is read in blocks; only the keys are kept.
    """
    if not path.exists():
        return OutputScan(KeyTable(), 0, 0, False)
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        complete_end = _end_of_last_line(fd, size)
        newlines, records = [0], []
        keys = KeyTable(records.append(number) or _record_key(path, number, raw) for number, raw in iter_lines(_blocks(fd, complete_end, newlines)))
        tail = os.pread(fd, size - complete_end, complete_end) if size > complete_end else b""
    if not tail.strip():
        return OutputScan(keys, size, size, False, len(records))
    if _is_torn_record(tail):
        return OutputScan(keys, size, complete_end, False, len(records))
    keys.add(_record_key(path, newlines[0] + 1, tail))
    return OutputScan(keys, size, size, True, len(records) + 1)


_SCAN_BLOCK = 1 << 20


def _blocks(fd: int, end: int, newlines: list[int]):
    """The file's bytes [0, end) in blocks; counts their newlines into newlines[0]."""
    offset = 0
    while offset < end:
        block = os.pread(fd, min(_SCAN_BLOCK, end - offset), offset)
        if not block:
            break
        newlines[0] += block.count(b"\n")
        yield block
        offset += len(block)


def _end_of_last_line(fd: int, size: int) -> int:
    """The offset just past the file's last b"\\n" (0 when it has none), read backwards in blocks."""
    end = size
    while end > 0:
        start = max(0, end - _SCAN_BLOCK)
        position = os.pread(fd, end - start, start).rfind(b"\n")
        if position >= 0:
            return start + position + 1
        end = start
    return 0


def repair_output(path: Path, scan: OutputScan) -> None:
    """Cut a torn last record off, or restore a whole last record's newline; the file must be unchanged
    since the scan (checked by its size)."""
    if not scan.needs_repair:
        return
    with open(path, "r+b") as f:
        if os.fstat(f.fileno()).st_size != scan.size:
            raise ResumeError(f"cannot resume: {path} changed while it was being checked")
        if scan.add_newline:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(scan.keep_bytes)
        f.flush()
        os.fsync(f.fileno())


def _is_torn_record(tail: bytes) -> bool:
    """The start of a record cut off by a kill: not JSON, and it begins as every record begins. (A tail
    that parses is a whole line: a record whose newline was lost, or not a record at all.)"""
    if not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail)):
        return False
    try:
        json.loads(tail.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return True
    return False


def _record_key(path: Path, number: int, raw: bytes) -> str:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise ResumeError(f"cannot resume: {path} line {number} is not a JSON record; fix or remove that line, or use --overwrite") from None
    if isinstance(record, dict) and isinstance(record.get("key"), str):
        return record["key"]
    raise ResumeError(f"cannot resume: {path} line {number} has no 'key' (it is not a jaxinfer result record); use --overwrite to start over")

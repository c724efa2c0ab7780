"""The model cache: converted models written atomically, checked on every load.

Layout: `<cache>/models/<name>/` holds a Hugging Face directory plus
`draftwise-manifest.json`, written last, recording the source file's SHA-256 and
the size and SHA-256 of every file. Loads check sizes (fast); `draftwise models
--verify` checks hashes. An entry without a manifest, or whose files do not match
it, is incomplete: it is rebuilt with a message. A build writes into a temporary
sibling directory and renames it into place, so an interrupted build or a full
disk leaves the cache as it was. The cache root is `~/.cache/draftwise`, or
`$DRAFTWISE_CACHE`.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

MANIFEST = "draftwise-manifest.json"


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTWISE_CACHE") or Path.home() / ".cache" / "draftwise").expanduser()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def entry_dir(name: str) -> Path:
    return cache_root() / "models" / name


def entry_problem(path: Path, source_sha256: str | None = None, *, verify: bool = False) -> str | None:
    """Why a cache entry cannot be used (None when it is complete and matches its manifest).

    verify=True also recomputes every file's SHA-256 (slow for large weights)."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        return "not built yet"
    if not manifest_path.is_file():
        return "incomplete (no manifest)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, OSError):
        return "manifest unreadable"
    if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
        return "built from a different source file"
    for rel, record in files.items():
        file = path / rel
        if not file.is_file():
            return f"missing {rel}"
        if file.stat().st_size != record["size"]:
            return f"{rel} has {file.stat().st_size} bytes, manifest says {record['size']}"
        if verify and sha256_file(file) != record["sha256"]:
            return f"{rel} does not match its SHA-256"
    return None


@contextlib.contextmanager
def _lock(name: str, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """One builder of `name` at a time; the others wait, then reuse its result. A wait is said in one line naming
    the holder's PID (written into the lock file while held): a holder that is paused (SIGSTOP) or slow is then
    visible instead of a silent hang."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            (log or (lambda m: print(m, file=sys.stderr)))(
                f"draftwise: waiting for another draftwise process (PID {holder}) preparing {name}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_entry(
    name: str, build: Callable[[Path], None], *, source_sha256: str | None = None, log: Callable[[str], None] | None = None,
    supersedes: str | None = None, source: str | None = None,
) -> Path:
    """Return the complete cache entry `name`, building it with `build(tmp_dir)` when missing or broken.

    `supersedes`, `source`: an entry keyed by its source file's state (`<prefix><12 hex digits>`, the prefix being
    `supersedes`) replaces the entries of that prefix built from an earlier state of the same `source` file (or
    from a file not recorded, by an earlier draftwise): once the new entry is in place they are removed, so a
    changed file does not leave another copy behind each time."""
    log = log or (lambda message: print(message, file=sys.stderr))
    final = entry_dir(name)
    if entry_problem(final, source_sha256) is None:
        return final
    with _lock(name, log):
        problem = entry_problem(final, source_sha256)
        if problem is None:  # another process built it while we waited
            return final
        if final.exists():
            log(f"draftwise: cache entry {final} is {problem}; rebuilding it")
        else:
            log(f"draftwise: preparing {name} in {final} (once)")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=final.parent))
        try:
            build(tmp)
            files = {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            manifest = {"name": name, "source_sha256": source_sha256, "files": files}
            if source is not None:
                manifest["source"] = source
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            _fsync_tree(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
            if final.exists():
                stale = final.with_name(f".{name}.stale-{os.getpid()}")
                os.replace(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if supersedes is not None:
        _remove_superseded(name, supersedes, source, log)
    return final


def _remove_superseded(name: str, prefix: str, source: str | None, log: Callable[[str], None]) -> None:
    """Remove the entries `<prefix><12 hex digits>` other than `name` built from `source` (or from a source not
    recorded), each under its own lock; one line says what was freed."""
    models = entry_dir(name).parent
    removed, freed = [], 0
    for path in sorted(models.glob(f"{glob.escape(prefix)}*")):
        rest = path.name[len(prefix):]
        if path.name == name or not path.is_dir() or len(rest) != 12 \
                or any(c not in "0123456789abcdef" for c in rest):
            continue
        try:
            recorded = json.loads((path / MANIFEST).read_text()).get("source")
        except (OSError, ValueError, AttributeError):
            recorded = None  # no manifest: an entry left incomplete, superseded too
        if recorded not in (None, source):
            continue  # another file of the same name: its own entry
        with _lock(path.name):
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            stale = path.with_name(f".{path.name}.stale-{os.getpid()}")
            try:
                os.replace(path, stale)  # out of sight at once, then deleted
            except OSError:
                continue
            shutil.rmtree(stale, ignore_errors=True)
        removed.append(path.name)
        freed += size
    if removed:
        log(f"draftwise: removed {len(removed)} superseded cache "
            f"entr{'y' if len(removed) == 1 else 'ies'} of {prefix.rstrip('-')} ({freed / 2**20:.1f} MB): "
            f"{', '.join(removed)}")


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


def list_entries(*, verify: bool = False) -> dict[str, str]:
    """name -> 'ready' or the problem, for every entry directory in the cache."""
    models = cache_root() / "models"
    if not models.is_dir():
        return {}
    return {
        p.name: entry_problem(p, verify=verify) or "ready"
        for p in sorted(models.iterdir())
        if not p.name.startswith(".")
    }


def gguf_cache_name(path: Path) -> tuple[str, str]:
    """(cache entry name, source key) of a GGUF file: keyed by its absolute path, size and mtime,
    so a changed file is converted again and an unchanged one never is."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    safe_stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:64]
    return f"gguf-{safe_stem}-{key[:12]}", key

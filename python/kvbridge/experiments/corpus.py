"""Text that no one here wrote, from files every machine running kvbridge has: the Python
standard library's own source (the ``.py`` files of the interpreter that runs kvbridge) and the
license texts of Debian's ``base-files`` package (``/usr/share/common-licenses``). Code and
English prose, the two kinds of long prompt serving platforms see most.

Files are split into training and held-out files by a hash of their name (never by window), so
that no held-out window shares a file with the data an adapter was fitted on. Windows are
consecutive, non-overlapping pieces of ``window_bytes`` UTF-8 bytes of a file (cut back to a
character boundary), at most ``per_file`` of them from one file, taken round-robin over files so
that a budget of windows spans many files.
"""
from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from typing import Dict, Iterable, List, Sequence, Tuple

#: Debian's license texts (package base-files).
LICENSES_DIR = pathlib.Path("/usr/share/common-licenses")
#: Smallest file taken: shorter ones hold at most a window or two of boilerplate.
MIN_FILE_BYTES = 4096


def stdlib_files() -> List[pathlib.Path]:
    """The Python standard library's top-level ``.py`` files of at least MIN_FILE_BYTES."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size >= MIN_FILE_BYTES)


def license_files() -> List[pathlib.Path]:
    """Debian's license texts of at least MIN_FILE_BYTES (none where the folder is absent)."""
    if not LICENSES_DIR.is_dir():
        return []
    return sorted(p for p in LICENSES_DIR.iterdir()
                  if p.is_file() and not p.is_symlink() and p.stat().st_size >= MIN_FILE_BYTES)


def default_files() -> List[pathlib.Path]:
    """The default corpus: stdlib_files() and license_files()."""
    return stdlib_files() + license_files()


def is_heldout(path: pathlib.Path, heldout_share: float = 0.25, seed: int = 0) -> bool:
    """Whether a file is held out: a hash of its name and the seed, not of where it lies, so the
    split is the same on every machine."""
    digest = hashlib.sha256(f"{seed}:{path.name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < heldout_share


def split_files(files: Sequence[pathlib.Path], heldout_share: float = 0.25,
                seed: int = 0) -> Tuple[List[pathlib.Path], List[pathlib.Path]]:
    """(training files, held-out files)."""
    train = [p for p in files if not is_heldout(p, heldout_share, seed)]
    heldout = [p for p in files if is_heldout(p, heldout_share, seed)]
    return train, heldout


def read_text(path: pathlib.Path) -> str:
    """A file's text ("" for one that is not UTF-8)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def file_windows(text: str, window_bytes: int, per_file: int) -> List[str]:
    """Consecutive windows of `window_bytes` bytes of `text` (each cut back to a character
    boundary), at most `per_file`; a shorter remainder is dropped."""
    raw = text.encode("utf-8")
    out, start = [], 0
    while len(out) < per_file and start + window_bytes <= len(raw):
        piece = raw[start:start + window_bytes].decode("utf-8", errors="ignore")
        if piece.strip():
            out.append(piece)
        start += window_bytes
    return out


def windows(files: Iterable[pathlib.Path], window_bytes: int, count: int,
            per_file: int = 4) -> List[str]:
    """Up to `count` windows, round-robin over the files (see the module docstring)."""
    per: List[List[str]] = [file_windows(read_text(p), window_bytes, per_file) for p in files]
    out: List[str] = []
    for i in range(per_file):
        for ws in per:
            if i < len(ws):
                out.append(ws[i])
                if len(out) >= count:
                    return out
    return out


def describe(files: Sequence[pathlib.Path]) -> Dict[str, int]:
    """Files and bytes of a file list (for reports)."""
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


__all__ = ["LICENSES_DIR", "MIN_FILE_BYTES", "default_files", "describe", "file_windows",
           "is_heldout", "license_files", "read_text", "split_files", "stdlib_files", "windows"]

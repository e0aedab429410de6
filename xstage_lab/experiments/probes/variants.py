"""A probe's variants of a committed kernel: ``NAME=FILE`` arguments, each a copy of a kernel
source (another commit's, ``git show COMMIT:kernels/FILE``, or a patched one) run beside the
committed kernel in one rotation, so that a change is read from ratios of one run."""
from __future__ import annotations

import hashlib
from pathlib import Path


def parse_variants(texts: list[str], taken: tuple[str, ...], suffix: str) -> dict[str, Path]:
    """``["NAME=FILE", ...]`` -> {NAME: path}; ValueError for a name that is not a plain name,
    is one of ``taken`` (the committed variants) or comes twice, or a file that is missing or does
    not end in ``suffix``."""
    out: dict[str, Path] = {}
    for text in texts:
        name, sep, path = text.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"{text!r}: expected NAME=FILE{suffix} with NAME a plain name")
        if name in taken or name in out:
            raise ValueError(f"variant {name}: the name is taken ({', '.join([*taken, *out])})")
        if not path.endswith(suffix) or not Path(path).is_file():
            raise ValueError(f"variant {name}: no {suffix} file {path}")
        out[name] = Path(path)
    return out


def file_digests(variants: dict[str, Path]) -> dict[str, str]:
    """Each variant's file by name and SHA-256, for the record: the files are not committed."""
    return {name: f"{path.name} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
            for name, path in variants.items()}

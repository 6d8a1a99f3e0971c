"""Build a directory once, atomically: write a private sibling folder, then rename it into place.

Three builders share this (the synthetic dataset, the tiny model, the warm-started detector). Each
writes a marker file (its manifest or build record) that says with which parameters the folder was
built; ``is_built(out)`` compares it with the wanted ones. The protocol, and why:

* already built with these parameters → nothing to do (cached: ``make demo`` twice builds once);
* ``out`` holds files but no marker → refuse: a folder this builder did not write is never deleted;
* build into ``.<name>.tmp-<pid>`` next to ``out`` → a killed build leaves only that folder, never a
  half-written ``out``;
* a concurrent builder may finish first: check again before replacing, and accept its result when
  the rename loses a race to an equal build.

What this module does not know: what is built.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def build_once(out: str | os.PathLike[str], *, marker: str, is_built: Callable[[Path], bool],
               write: Callable[[Path], object], owner: str, force: bool = False) -> tuple[Path, bool]:
    """``out`` built by ``write(tmp_dir)`` unless ``is_built(out)``; returns (path, built_now).

    ``marker``: the file name ``write`` leaves in a finished build (written last); ``owner``: the
    command that builds it, named in the error for a foreign folder. ``force`` rebuilds regardless.
    """
    out = Path(out)
    if not force and is_built(out):
        return out, False
    if out.exists() and not (out / marker).is_file() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and was not written by {owner}; pick another --out")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        if not force and is_built(out):  # a concurrent build finished first
            return out, False
        if out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if not is_built(out):  # someone else renamed a different build in
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, True

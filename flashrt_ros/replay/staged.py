"""Folders written whole or not at all: built beside their destination, then moved into place."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def staged_folder(final, replace: bool):
    """Yield a path (not yet existing, named like `final`) inside a temporary sibling folder of `final`; when
    the block ends without an error, that path takes `final`'s place (an existing folder there is replaced
    with replace=True). Whatever the block left is removed either way, so a failure leaves nothing behind."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield staging / final.name
        if replace and final.exists():
            os.replace(final, staging / f"{final.name}.old")  # (removed with the staging folder below)
        os.replace(staging / final.name, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

"""Editing a saved checkpoint the way a hostile (or careless) author would.

``manifest.sha256`` guards ``manifest.json`` against corruption; an author who edits the
manifest on purpose rewrites the digest too, which these helpers do.
"""
from __future__ import annotations

import json
import os
from typing import Any

from megashard import storage


def read_manifest_doc(ckpt: str) -> Any:
    with open(os.path.join(ckpt, storage.MANIFEST_NAME)) as f:
        return json.load(f)


def write_manifest_text(ckpt: str, text: str | bytes) -> None:
    """Replace manifest.json and keep its digest consistent."""
    data = text.encode() if isinstance(text, str) else text
    with open(os.path.join(ckpt, storage.MANIFEST_NAME), "wb") as f:
        f.write(data)
    with open(os.path.join(ckpt, storage.MANIFEST_DIGEST_NAME), "w") as f:
        f.write(storage.manifest_digest(data))


def write_manifest_doc(ckpt: str, doc: Any) -> None:
    write_manifest_text(ckpt, json.dumps(doc))

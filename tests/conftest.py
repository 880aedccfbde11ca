"""Marks every test that touches megatron-core or Megatron-LM ``megatron``: CI runs them on each
supported release (``.ci/run``'s Python 3.12 / megatron-core 0.19 leg runs ``-m megatron``).

A test module is Megatron's when its source imports megatron or megashard.megatron, uses the
Megatron test helpers (``megatron_helpers``, the Megatron-LM fixtures) or needs megatron.core; so
a new Megatron test joins that leg without being listed anywhere.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List

import pytest

_MEGATRON = re.compile(r"^\s*(from|import)\s+(megatron\b|megashard\.megatron\b|megatron_helpers\b|"
                       r"test_megatron_lm_install\b)|importorskip\(\s*[\"']megatron|_megatron_core\b", re.M)
_seen: Dict[str, bool] = {}


def touches_megatron(path: Path) -> bool:
    key = str(path)
    if key not in _seen:
        _seen[key] = bool(_MEGATRON.search(path.read_text(encoding="utf-8")))
    return _seen[key]


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        if touches_megatron(Path(str(item.fspath))):
            item.add_marker(pytest.mark.megatron)
from s3_endpoint import s3, s3_endpoint_server  # noqa: E402,F401  (S3 test endpoint fixtures, tests/s3_endpoint.py)

"""Shared test set-up: quiet, loopback-only NIXL/UCX defaults unless the user set them."""

from __future__ import annotations

import os

for _name, _value in (
    ("UCX_MEM_MMAP_HOOK_MODE", "none"),
    ("UCX_NET_DEVICES", "lo"),
    ("NIXL_LOG_LEVEL", "WARN"),
):
    os.environ.setdefault(_name, _value)

"""Model weights: the lossless delta codec, the object store and the version registry.

Submodules: :mod:`.codec` (pure), :mod:`.store` (object storage), :mod:`.registry` (versions in the
database). Names are re-exported lazily so that importing the store does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DeltaError": "codec",
    "apply_delta": "codec",
    "decode_full": "codec",
    "delta_stats": "codec",
    "encode_delta": "codec",
    "encode_full": "codec",
    "state_sha256": "codec",
    "FolderStore": "store",
    "InvalidKey": "store",
    "ObjectNotFound": "store",
    "Store": "store",
    "StoreError": "store",
    "make_store": "store",
    "Registry": "registry",
    "VersionInfo": "registry",
    "VersionNotFound": "registry",
    "WeightsError": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

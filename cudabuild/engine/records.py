"""The shape of an action record, checked the same way whichever tier it was read from.

A record is `{"stage", "digest", "outputs": {name: sha256}, "finals": [name], "value", "seconds",
"created"}` (see action_cache.py). The local store and the remote tier both check each record they read
with `well_formed` and treat one that fails as a miss, so a damaged record makes its stage run
again instead of failing a build (a KeyError in a restore) or writing outside build/.
Imports nothing else from cudabuild: both tiers use it, and neither may import the other for it.
"""

from __future__ import annotations

import re

_SHA = re.compile(r"^[0-9a-f]{64}$")


def well_formed(record) -> bool:
    """A record's shape: output names are plain file names (they become paths in build/), shas are hex."""
    if not isinstance(record, dict) or not isinstance(record.get("outputs"), dict):
        return False
    outputs = record["outputs"]
    for name, sha in outputs.items():
        if not (isinstance(sha, str) and _SHA.match(sha)) or not _plain_name(name):
            return False
    finals = record.get("finals", [])
    return isinstance(finals, list) and all(name in outputs for name in finals) and "digest" in record


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name

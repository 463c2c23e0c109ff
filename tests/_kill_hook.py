"""Fault injection inside a build: SIGKILL the build's process group at an exact moment of a cache write.

Opt-in only: nothing happens on import; a process that calls `install()` (see _faults.start_export's
kill_hook=True, which runs doit through `python -c` with this hook installed first) gets diskcache's
`Disk.store` wrapped so that, the first time a blob (`blob:<sha>`, stored with read=True by
cudabuild.engine.object_store.ObjectStore.put_file/put_bytes) has been written, right after `Disk.store` returned, the
process kills its own process group with SIGKILL.

At that moment diskcache (Cache.set: `self._disk.store(...)`, then the row in a SQLite transaction)
has written the blob's file completely and closed it, and has not yet committed the row that names
it: the kill lands exactly between "blob file written" and "row committed". Before dying the hook
writes one line, `MARKER <key> <filename>`, to stderr so a test can find the file it left behind.
"""

from __future__ import annotations

import os
import signal

MARKER = "kill_hook: SIGKILL after writing"

_installed = False


def install(prefix: str = "blob:") -> None:
    """Wrap diskcache.core.Disk.store (every Cache's disk, for the rest of this process)."""
    global _installed
    if _installed:
        return
    from diskcache.core import UNKNOWN, Disk

    original = Disk.store

    def store(self, value, read, key=UNKNOWN):
        result = original(self, value, read, key=key)
        if read and isinstance(key, str) and key.startswith(prefix):
            filename = result[2]  # (size, mode, filename, db_value): the file is complete on disk
            os.write(2, f"{MARKER} {key} {filename}\n".encode())
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return result

    Disk.store = store
    _installed = True

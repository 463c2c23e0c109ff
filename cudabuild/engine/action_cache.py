"""The action cache: what a stage with a given action key produced (its record), and the small
documents kept beside the records, here and in the shared tier behind this cache.

Rows (cudabuild.engine.diskcache_rows.Table):
- `rec:<key>`  -> JSON: what a stage with that action key produced
  (`{"stage", "digest", "outputs": {name: sha256}, "finals", "value", "seconds", "created"}`), its
  outputs' bytes in the object store (cudabuild.engine.object_store);
- `doc:<name>` -> a small JSON document: what a recipe declares, what its options resolve to, a
  compile's tuning decisions (those three kinds also kept in the shared tier: SHARED_DOCS), a Hub
  snapshot's place;
- `log:<time>:<pid>` -> one finished build's manifest: the build log `cudabuild cache stats` and
  `report` read.

A record is read one way here (`local_record`: this cache alone, without counting as a use) and
one way through the tiers (`lookup`: here, then the shared tier; `take` marks the use and copies a
record found there in, which a build does and a look does not). Either way a record is only
trusted when it is well formed (cudabuild.engine.records, the check the remote tiers apply too)
and the blobs it names are present (here, or for `lookup` in the tier); a damaged one is warned
about, dropped, and read as a miss, so its stage runs again.

With $CUDABUILD_REMOTE set, `push` and `publish` write a new record back to the shared tier, its
blobs first. `restore` and `store` move a record's outputs between the cache and a build directory:
its final outputs into build/ on the way out, a stage's files in (then its record) on the way in.

Owns records, documents and the build log, restoring and storing what a record names, and the
write-back. Must not touch: the blobs' bytes (the object store's), the decision or the stamps
(runner.py), or how a stage runs (executors.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from cudabuild.errors import CorruptBlob, CudabuildError, MissingBlob
from cudabuild.engine.console import terminal, trace
from cudabuild.engine.diskcache_rows import Table
from cudabuild.engine.files import move_or_copy
from cudabuild.engine.hashing import digest
from cudabuild.engine.object_store import ObjectStore
from cudabuild.engine.records import well_formed

# A new record's write-back to the shared tier (publish), whole, as the tiers' clients try one
# call (cudabuild.engine.tiers.s3.client OP_ATTEMPTS, RETRY_PAUSE_S): each call retries first.
PUSH_ATTEMPTS = 3
PUSH_PAUSE_S = 0.2  # times the attempt number, between them

# Documents a shared tier keeps too: what a recipe declares and what its options resolve to (both
# keyed by the recipe's source digests), so a fresh machine restores without importing torch; and
# a compile's GEMM/conv tuning decisions (keyed by its tuning inputs), so it does not tune again.
SHARED_DOCS = ("recipe:", "options:", "tune:")


class ActionCache:
    """Records and documents in `table`, their blobs in `objects`; `remote`: the shared tier behind
    them (a cudabuild.engine.tiers Tier), or None."""

    def __init__(self, table: Table, objects: ObjectStore, remote=None):
        self.table, self.objects, self.remote = table, objects, remote
        self.root = table.root
        self._damaged_warned: set[str] = set()  # record keys already warned about (once each)

    # -- records -------------------------------------------------------------------------------

    def local_record(self, key: str) -> Optional[dict]:
        """The record for an action key in this cache, only if every blob it names is here too;
        read without counting as a use (a damaged one is still dropped, as every read drops it)."""
        record = self._checked(key, self.table.peek("rec:" + key))
        return record if record is not None and self._blobs_reachable(record, remote_ok=False) else None

    def lookup(self, key: str, take: bool = False) -> tuple[Optional[dict], str]:
        """(record, "local" or "remote"): the record for an action key, from this cache or else the
        shared tier, only if every blob it names is in one of them (fetch copies a blob in when it
        is needed); (None, "") when neither can serve it.

        `take` (a build, which serves what it finds): the local record's use is counted, and a
        record found in the shared tier is copied into this cache. Without it (explain, a wait for
        another builder, the summary) nothing changes.
        """
        raw = self.table.get("rec:" + key, f"record {key[:12]}") if take else self.table.peek("rec:" + key)
        record = self._checked(key, raw)
        if record is not None and self._blobs_reachable(record, remote_ok=True):
            return record, "local"
        record = self.remote.get_record(key) if self.remote is not None else None
        if record is None or not self._blobs_reachable(record, remote_ok=True):
            return None, ""
        if take:
            self.put_record(key, record)
        return record, "remote"

    def put_record(self, key: str, record: dict) -> None:
        record = dict(record, created=record.get("created") or time.time())
        self.table.set("rec:" + key, json.dumps(record, sort_keys=True), f"the record of {record.get('stage', key[:12])}")

    def drop_record(self, key: str) -> None:
        self.table.evict("rec:" + key)

    def _blobs_reachable(self, record: dict, remote_ok: bool) -> bool:
        """Every blob the record names is here, or (remote_ok) in the remote tier."""
        missing = [sha for sha in record.get("outputs", {}).values() if not self.objects.has_blob(sha)]
        return not missing or (remote_ok and self.remote is not None and self.remote.has_blobs(missing))

    def records(self) -> Iterator[tuple[str, dict]]:
        """Every well-formed (action key, record), without marking any as used; damaged ones are dropped."""
        for entry in self.table.entries("rec:"):
            key = entry.key[len("rec:"):]
            record = self._checked(key, self.table.peek(entry.key))
            if record is not None:
                yield key, record

    def _checked(self, key: str, raw) -> Optional[dict]:
        """The record a local `rec:` value holds, or None for none. A damaged one (not JSON, or not
        well formed: a missing digest, an output outside build/) is a miss: dropped, so it cannot
        be one again, and warned about once, so its stage running again has a reason."""
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except (ValueError, TypeError):  # TypeError: a value that is not text at all
            record = None
        if well_formed(record):
            return record
        self.drop_record(key)
        if key not in self._damaged_warned:
            self._damaged_warned.add(key)
            stage = record.get("stage") if isinstance(record, dict) else None
            of = f" of {stage}" if isinstance(stage, str) else ""
            damage = "is malformed" if isinstance(record, dict) else "is not a JSON object"
            terminal.warn(f"cached record {key[:12]}{of} in {self.root} {damage}; dropped, its stage will run again")
        return None

    # -- restore and store: a record's outputs in and out of a build directory ------------------

    def restore(self, key: str, record: dict, build_dir: Path) -> Optional[str]:
        """Put a record's final outputs in `build_dir`, each blob checked on its way (fetched from
        the shared tier where this cache lacks it; a file there the memo knows as that blob already,
        one a warm process just stored, is left as it is): "local", or "remote" when a final output
        came from the tier. None when a blob turns out unusable: warned about, and the record dropped
        (its stage runs again)."""
        finals = record.get("finals", [])
        source = "local" if all(self.objects.has_blob(record["outputs"][name]) for name in finals) else "remote"
        try:
            for name in finals:
                sha = record["outputs"][name]
                if self.objects.hasher.remembered(build_dir / name) != sha:
                    self.objects.fetch(sha, build_dir / name)
                    self.objects.hasher.remember(build_dir / name, sha)
        except (CorruptBlob, MissingBlob) as e:
            terminal.warn(str(e))
            self.drop_record(key)
            return None
        return source

    def store(self, key: str, stage: str, result, final: bool, build_dir: Path, started: float,
              handed_on: Callable[[dict], dict]) -> dict:
        """What the stage `stage` made (a StageResult) kept under `key`: its files into the object
        store (moved in, but for final outputs, `final`, which then move to `build_dir`), the
        outputs it handed on unchanged checked (`handed_on`: StageIO.handed_on), then its record,
        which it returns (its `seconds` counted from `started`, time.monotonic(), to now). Called
        while the stage's work folder still holds its files."""
        finals = sorted(result.files) if final else []
        with trace.phase("store writes"):
            # A work file is moved into the cache, not copied (a weights bundle of tens of GB is
            # never on the disk twice); a final output stays, for build/ (below).
            outputs = {name: self.objects.put_file(path, result.known.get(name), result.regions.get(name),
                                                   take=name not in finals)
                       for name, path in sorted(result.files.items())}
            outputs.update(handed_on(result.stored))
        seconds = round(time.monotonic() - started, 3)
        record = {"stage": stage, "digest": result.digest or digest(outputs), "outputs": outputs, "finals": finals,
                  "value": result.value, "seconds": seconds}
        for name in finals:
            # Moved where it can be (the work folder goes next): the .ptd the cache keeps as ranges
            # of the weights is then on the disk once, in build/.
            move_or_copy(result.files[name], build_dir / name)
            self.objects.hasher.remember(build_dir / name, outputs[name])
        self.put_record(key, record)
        return record

    # -- write-back to the shared tier ----------------------------------------------------------

    def write_back(self, stage: str, key: str, record: dict, required: bool = False) -> None:
        """A record just stored, published to the shared tier (when there is one that takes writes,
        or `required`), and said where it happens when the tier did not take it: where it had to (a
        cluster's worker, whose driver restores it from there), CudabuildError; else a warning (this
        cache keeps it; other machines build it themselves), unless the tier was given up, which
        its own one line said."""
        if self.remote is None or not (self.remote.writable or required):
            return
        with trace.phase("upload"):
            why = self.publish(key, record)  # blobs, then the record
        if why is None:
            return
        where = self.remote.where
        if not required and self.remote.down:
            return  # the tier's own line said it once ("unreachable ... continuing with the local cache only")
        if required:
            raise CudabuildError(f"stage {stage}: its result {key[:12]} was not written to the shared tier {where} "
                                 f"({why}), so the driver cannot restore it; fix the tier (its warning says what "
                                 "failed) and build again")
        terminal.warn(f"stage {stage}: its result {key[:12]} was not written to the shared tier {where} ({why}); "
                      "this cache keeps it, other machines will build it themselves")

    def push(self, key: str, record: dict, tier=None) -> bool:
        """Write a record back to the remote tier (`tier`, default self.remote): every blob it names
        first, then the record, so no reader there sees a record whose blobs are incomplete. False
        when there is no writable tier, a blob is missing here, or an upload did not complete."""
        return self._push(key, record, tier or self.remote) is None

    def publish(self, key: str, record: dict) -> Optional[str]:
        """push to the shared tier, tried again as the tiers try a call again (PUSH_ATTEMPTS, a
        longer pause each time) while it still takes writes: a fault one call's own retries did
        not outlast costs a second push, not the record. None once the record is there; else why
        not, in words, for the caller to say where it happens."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            why = self._push(key, record, self.remote)
            if why is None:
                return None
            # A tier given up, refusing writes or read-only refuses a try again too.
            if attempt == PUSH_ATTEMPTS or self.remote is None or not self.remote.writable:
                break
            time.sleep(PUSH_PAUSE_S * attempt)
        return why if attempt == 1 else f"{why}; tried {attempt} times"

    def _push(self, key: str, record: dict, tier) -> Optional[str]:
        """push: None once the record is in the tier, else why not."""
        if tier is None:
            return "no shared tier is set"
        if not tier.writable:
            return "it takes no writes from this process (read-only, or given up or refused a write earlier: see its warning)"
        for sha in sorted(set(record.get("outputs", {}).values())):
            if not self.objects.has_blob(sha) and tier.has_blobs([sha]):
                continue  # handed on unchanged from a stage that ran on another machine: the tier has it
            try:
                with self.objects.open_blob(sha) as handle:
                    if not tier.put_blob(sha, handle):
                        return f"the upload of blob {sha[:12]} failed"
            except MissingBlob:
                return f"blob {sha[:12]} is in neither this cache nor the tier"
        return None if tier.put_record(key, record) else "the write of its record failed"

    # -- small JSON documents (recipe descriptions, tuning decisions) ----------------------------

    def get_json(self, name: str) -> Optional[dict]:
        raw = self.table.get("doc:" + name, _doc_what(name))
        if raw is not None:
            return json.loads(raw)
        if self.remote is None or not name.startswith(SHARED_DOCS):
            return None
        # A fresh machine: what a recipe declares may already be known to the fleet, so the build
        # restores without importing the recipe (and torch). Copied in, so it is asked once.
        record = self.remote.get_record(_doc_key(name))
        value = (record or {}).get("value")
        if not isinstance(value, dict):
            return None
        self._put_doc(name, value)
        return value

    def put_json(self, name: str, value: dict) -> None:
        self._put_doc(name, value)
        if self.remote is not None and self.remote.writable and name.startswith(SHARED_DOCS):
            self.remote.put_record(_doc_key(name), _doc_record(name, value))

    def _put_doc(self, name: str, value: dict) -> None:
        """The local write of a document, whether made here or copied in from the shared tier."""
        self.table.set("doc:" + name, json.dumps(value, sort_keys=True), _doc_what(name))

    def shared_docs(self) -> Iterator[tuple[str, dict]]:
        """(tier key, record) of every document the shared tier also keeps (see SHARED_DOCS)."""
        for entry in self.table.entries("doc:"):
            name = entry.key[len("doc:"):]
            raw = self.table.peek(entry.key) if name.startswith(SHARED_DOCS) else None
            if raw is not None:
                yield _doc_key(name), _doc_record(name, json.loads(raw))

    # -- build log (what `cudabuild cache stats` summarises) ------------------------------------

    def record_build(self, manifest: dict) -> None:
        """Append one finished build's manifest (stages, statuses, seconds) to the log."""
        # The options and specs too: `cudabuild report` tells builds of other settings apart by them.
        entry = {k: manifest[k] for k in ("model", "target", "options", "specs", "stages", "outputs") if k in manifest}
        entry["time"] = time.time()
        self.table.set(f"log:{entry['time']:017.6f}:{os.getpid()}", json.dumps(entry, sort_keys=True), "the build log")

    def build_log(self, last: Optional[int] = None) -> list[dict]:
        """Logged builds, oldest first; the last `last` only when given."""
        keys = sorted(entry.key for entry in self.table.entries("log:"))
        if last is not None:
            keys = keys[-last:] if last > 0 else []
        entries = []
        for key in keys:
            raw = self.table.get(key, "the build log")
            if raw is not None:
                entries.append(json.loads(raw))
        return entries



def _doc_what(name: str) -> str:
    return f"the {name.partition(':')[0]} document"  # "recipe:<digest>" -> "the recipe document"


def _doc_key(name: str) -> str:
    return hashlib.sha256(("doc:" + name).encode()).hexdigest()


def _doc_record(name: str, value: dict) -> dict:
    # The shape of an action record (no outputs), so both tiers store, sign and check it as one.
    return {"stage": "doc " + name.partition(":")[0], "digest": _doc_key(name), "outputs": {}, "value": value}

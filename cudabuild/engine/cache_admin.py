"""Looking after the store: `cudabuild cache stats | verify | gc`, size limits, and what is pinned.

- pins: every blob a stamp under <project>/build/*/*/.stamps/ names, and the record of every
  stamp's key. What build/ references is never evicted, so a build in progress (which writes its
  stamps as it goes) never loses an input it still needs.
- gc: least-recently-used eviction of unpinned blobs and records (diskcache's access_time, which
  only builds move), down to a size and/or past an age; records left naming an evicted blob go too.
  The folders stages keep beside the store (compiled Triton kernels) are gc'd with it, entry by
  entry (`folder_entries`): past the age, and first under a size limit, since a kernel recompiles
  in a second where a blob may have taken an hour.
  With dry_run it works out the same evictions and changes nothing (`cudabuild cache gc --dry-run`).
- enforce_limit: the gc a build runs after each stage it stores, under $CUDABUILD_CACHE_MAX_SIZE.
- verify: re-hash every blob, drop the corrupt ones and the records that named them.
- stats: the store's contents, and what the build log says the cache did for the last N builds.

The size `cache gc --max-size` bounds is the bytes of blobs, records and the folders beside the
store; the limit a build enforces after each stage ($CUDABUILD_CACHE_MAX_SIZE) bounds blobs and
records, which one SQL sum gives, without walking the kernel folder on a build's path (the memo,
docs and build log are bookkeeping, a few KiB). Reads go through the table's inspection methods
(cudabuild.engine.diskcache_rows.Table), which do not count as uses.
This module builds on the store (its table, object store and action cache) and none of them
imports it: what is in use (the pins) is worked out here, above the store, as dvc-data's
gc(odb, used) has its caller do. Nothing here imports torch.

Owns the cache tools (stats, verify, gc, here and of an S3 tier: `gc_remote`) and the pins. Must
not touch: how the store keeps an entry (the table, the object store, the action cache say that).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from cudabuild.errors import InvalidOption, InvalidRemote
from cudabuild.engine.stamp import all_stamps
from cudabuild.engine.store import Store

# -- sizes ---------------------------------------------------------------------------------------

MAX_SIZE_ENV = "CUDABUILD_CACHE_MAX_SIZE"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
          "ti": 2**40, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, where: str = "size") -> int:
    """Bytes from `500M`, `2G`, `1.5GiB`, `123456`: K/M/G/T are powers of 1000, KiB/MiB/GiB/TiB of 1024."""
    match = _SIZE.match(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise InvalidOption(f"{where} '{text}' is not a size", fix="use bytes or a number with K, M, G, T (powers of "
                            "1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 500M or 1.5GiB")
    return int(float(match.group(1)) * unit)


def plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# -- pins ----------------------------------------------------------------------------------------


@dataclass
class Pins:
    blobs: set[str] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    stamps: int = 0

    def holds(self, entry_key: str) -> bool:
        kind, _, name = entry_key.partition(":")
        return name in (self.blobs if kind in ("blob", "spans") else self.keys if kind == "rec" else ())

    def with_spans(self, store: Store) -> "Pins":
        """These pins, and the blobs each pinned blob kept as spans reads from (cudabuild.engine.spans)."""
        from cudabuild.engine.spans import referenced

        for sha in list(self.blobs):
            manifest = store.objects.spans_of(sha)
            if manifest is not None:
                self.blobs.update(referenced(manifest))
        return self


def pins(project: Path) -> Pins:
    found = Pins()
    for _, stamp in all_stamps(project):
        found.stamps += 1
        found.blobs.update(stamp.outputs.values())
        found.keys.add(stamp.key)
    return found


def _dangling_records(store: Store, evicted: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """[(key, stage)] of records that name a blob the store no longer has, counting the entries in
    `evicted` ("blob:<sha>", "rec:<key>") as gone already (what a dry run would have evicted)."""
    dangling = []
    for key, record in store.actions.records():
        if "rec:" + key in evicted:
            continue
        if not all("blob:" + sha not in evicted and store.objects.has_blob(sha) for sha in (record.get("outputs") or {}).values()):
            dangling.append((key, record.get("stage", "?")))
    return dangling


def _drop_dangling_records(store: Store) -> list[tuple[str, str]]:
    """Drop records that name a blob the store no longer has; [(key, stage)] of those dropped."""
    dropped = _dangling_records(store)
    for key, _ in dropped:
        store.actions.drop_record(key)
    return dropped


# -- gc ------------------------------------------------------------------------------------------


@dataclass
class GcReport:
    evicted_blobs: int = 0
    evicted_records: int = 0
    evicted_bytes: int = 0
    dangling_records: int = 0
    orphan_files: int = 0
    orphan_bytes: int = 0
    work_folders: int = 0  # work folders of killed stages (ObjectStore.orphan_work)
    work_bytes: int = 0
    size_after: int = 0
    pinned_bytes: int = 0
    pinned_blobs: int = 0
    stamps: int = 0
    max_bytes: Optional[int] = None
    max_age_days: Optional[float] = None
    dry_run: bool = False  # what a gc would do: nothing was evicted or deleted
    evicted_beside: dict = field(default_factory=dict)  # folder beside the store -> (entries, bytes)

    def lines(self) -> list[str]:
        rules = []
        if self.max_bytes is not None:
            rules.append(f"limit {format_bytes(self.max_bytes)}")
        if self.max_age_days is not None:
            rules.append(f"max age {self.max_age_days:g} days")
        evicted, dropped, kept, deleted, store_now, was_kept = (
            ("would evict", "would drop", "would keep", "would delete", "store would be", "it would be kept")
            if self.dry_run else ("evicted", "dropped", "kept", "deleted", "store now", "it was kept"))
        dangling = ""
        if self.dangling_records:
            dangling = f"; {dropped} {plural(self.dangling_records, 'record')} left without their blobs"
        out = [
            f"{evicted} {plural(self.evicted_blobs, 'blob')} and {plural(self.evicted_records, 'record')} "
            f"({format_bytes(self.evicted_bytes)}), least recently used first{dangling}",
            f"{store_now} {format_bytes(self.size_after)} in blobs and records ({', '.join(rules)}); "
            f"{kept} {plural(self.pinned_blobs, 'blob')} ({format_bytes(self.pinned_bytes)}) "
            f"that {plural(self.stamps, 'stamp')} under build/ reference",
        ]
        for name, (count, size) in sorted(self.evicted_beside.items()):
            out.append(f"{evicted} {plural(count, 'entry', 'entries')} ({format_bytes(size)}) of {name}/ beside the "
                       "store, least recently used first")
        if self.orphan_files:
            out.append(f"{deleted} {plural(self.orphan_files, 'orphaned file')} ({format_bytes(self.orphan_bytes)}) "
                       f"that killed cache writes left behind")
        if self.work_folders:
            out.append(f"{deleted} {plural(self.work_folders, 'work folder')} ({format_bytes(self.work_bytes)}) "
                       f"that killed stages left behind")
        if self.max_bytes is not None and self.pinned_bytes > self.max_bytes:
            out.append(f"note: what build/ references alone is over the limit; {was_kept} "
                       "(delete build/<model> folders to release it)")
        return out


def gc(store: Store, project: Path, max_bytes: Optional[int] = None, max_age_days: Optional[float] = None,
       now: Optional[float] = None, dry_run: bool = False, beside: bool = True) -> GcReport:
    """Evict unpinned blobs and records: older than max_age_days, then least recently used until
    max_bytes. Also deletes files that killed writes left without a row (Table.sweep_orphans).
    With dry_run, the report says what would be evicted and deleted, and the store is left as it is.
    With beside=False, the folders beside the store are neither counted nor evicted."""
    now = time.time() if now is None else now
    pinned = pins(project).with_spans(store)
    entries = store.table.entries("blob:") + store.table.entries("spans:") + store.table.entries("rec:")
    report = GcReport(max_bytes=max_bytes, max_age_days=max_age_days, stamps=pinned.stamps, dry_run=dry_run)
    kept = [e for e in entries if pinned.holds(e.key)]
    report.pinned_blobs = sum(1 for e in kept if e.key.startswith(("blob:", "spans:")))
    report.pinned_bytes = sum(e.bytes for e in kept)
    total = sum(e.bytes for e in entries)
    beside_left = _gc_beside(store.root, report, total, now, dry_run) if beside else 0
    total += beside_left
    evicted: set[str] = set()  # a dry run's evictions: noted, and taken to succeed
    for entry in sorted((e for e in entries if not pinned.holds(e.key)), key=lambda e: (e.access_time, e.key)):
        too_old = max_age_days is not None and entry.access_time < now - max_age_days * 86400
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            continue
        if dry_run:
            evicted.add(entry.key)
        elif not store.table.evict(entry.key):
            continue
        total -= entry.bytes
        report.evicted_bytes += entry.bytes
        if entry.key.startswith(("blob:", "spans:")):
            report.evicted_blobs += 1
        else:
            report.evicted_records += 1
    if dry_run:
        if report.evicted_blobs:
            dangling = {"rec:" + key for key, _ in _dangling_records(store, frozenset(evicted))}
            report.dangling_records = len(dangling)
            total -= sum(e.bytes for e in entries if e.key in dangling)
        orphans = store.table.orphan_files(now=now)
        report.orphan_files, report.orphan_bytes = len(orphans), sum(size for _, size in orphans)
        work = store.objects.orphan_work()
        report.work_folders, report.work_bytes = len(work), sum(size for _, size in work)
        report.size_after = total - beside_left
        return report
    if report.evicted_blobs:
        report.dangling_records = len(_drop_dangling_records(store))
    report.orphan_files, report.orphan_bytes = store.table.sweep_orphans(now=now)
    report.work_folders, report.work_bytes = store.objects.sweep_work()
    report.size_after = store.table.size()
    return report


@dataclass(frozen=True)
class FolderEntry:
    """One entry of a folder kept beside the store: a directory that holds files (a compiled
    Triton kernel's), its bytes, and when it was last used (its files' latest access or change:
    Triton reads an entry's files on a hit, writes them on a miss)."""

    path: Path
    bytes: int
    last_used: float


def folder_entries(folder: Path) -> list[FolderEntry]:
    found: dict[Path, list[os.stat_result]] = {}
    for file in folder.rglob("*"):
        try:
            if file.is_file() and not file.is_symlink():
                found.setdefault(file.parent, []).append(file.stat())
        except OSError:  # removed by a concurrent build or gc
            continue
    return [FolderEntry(path, sum(st.st_size for st in stats), max(max(st.st_atime, st.st_mtime) for st in stats))
            for path, stats in found.items()]


def _gc_beside(root: Path, report: GcReport, store_bytes: int, now: float, dry_run: bool) -> int:
    """Evict entries of the folders beside the store (see the module docstring), given the
    store's bytes; returns the bytes those folders hold after it."""
    entries = [(folder.name, entry) for folder in _beside(root) for entry in folder_entries(folder)]
    total = store_bytes + sum(entry.bytes for _, entry in entries)
    for name, entry in sorted(entries, key=lambda item: item[1].last_used):
        too_old = report.max_age_days is not None and entry.last_used < now - report.max_age_days * 86400
        too_big = report.max_bytes is not None and total > report.max_bytes
        if not (too_old or too_big):
            continue
        if not dry_run and not _remove_entry(entry.path):
            continue
        total -= entry.bytes
        count, size = report.evicted_beside.get(name, (0, 0))
        report.evicted_beside[name] = (count + 1, size + entry.bytes)
    return total - store_bytes


def _remove_entry(path: Path) -> bool:
    """Delete an entry as one step: renamed away first, so a build reading the folder finds the
    whole entry or none of it (a miss: the kernel is compiled again)."""
    doomed = path.with_name(f".gc-{path.name}-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def enforce_limit(store: Store, project: os.PathLike | str) -> Optional[GcReport]:
    """Keep blobs and records under $CUDABUILD_CACHE_MAX_SIZE (unset: no limit); the runner calls it
    after each stage it stores.

    Evicts least-recently-used entries that no stamp under `project`/build/ references (see gc), so
    the current build's own inputs and outputs are never evicted, and what was evicted is never
    needed again by this build. Cheap when under the limit: one SQL sum.
    Returns the GcReport when it evicted something, else None.
    """
    raw = os.environ.get(MAX_SIZE_ENV, "").strip()
    if not raw:
        return None
    limit = parse_size(raw, where=MAX_SIZE_ENV)
    if store.table.size() <= limit:
        return None
    return gc(store, Path(project), max_bytes=limit, beside=False)


# -- gc of the shared tier ------------------------------------------------------------------------


def gc_remote(max_size: Optional[str], keep_days: float, dry_run: bool = False) -> list[str]:
    """`cudabuild cache gc --remote`: the tier the environment names, its blobs bounded to
    --max-size (cudabuild.engine.tiers.s3.gc); the lines that say what it did."""
    from cudabuild.engine.tiers import factory
    from cudabuild.engine.tiers.base import BLOBS_ENV, REMOTE_ENV
    from cudabuild.engine.tiers.s3 import gc as s3_gc

    if not max_size:
        raise InvalidRemote("cache gc --remote needs --max-size SIZE (what the object store's blobs may take)")
    tier = factory.from_env()
    if tier is None:
        raise InvalidRemote(f"cache gc --remote needs the shared tier: set {REMOTE_ENV} (and {BLOBS_ENV})")
    return remote_gc_lines(s3_gc.gc_remote(tier, parse_size(max_size, "--max-size"), keep_days, dry_run=dry_run))


def remote_gc_lines(report) -> list[str]:
    """What a gc of the shared tier did (a tiers.s3.gc.RemoteGcReport), in words."""
    out = [f"remote {report.where}: {plural(report.blobs, 'blob')}, {format_bytes(report.before)}; "
           f"{'would evict' if report.dry_run else 'evicted'} {plural(len(report.evicted), 'blob')} "
           f"({format_bytes(report.evicted_bytes)}), {'then' if report.dry_run else 'now'} {format_bytes(report.after)} "
           f"of {format_bytes(report.limit)}"]
    if report.after > report.limit:
        out.append(f"still over the limit: {plural(report.pinned, 'blob')} named by records younger than the kept "
                   f"days and {plural(report.recent, 'blob')} used in the last hour are never evicted")
    return out


# -- verify --------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    checked: int = 0
    checked_bytes: int = 0
    dropped: list[str] = field(default_factory=list)  # "sha12 (stage name)"
    dropped_records: list[str] = field(default_factory=list)  # "stage (key12)"
    stamps_affected: list[str] = field(default_factory=list)  # "model/target/stage"

    @property
    def clean(self) -> bool:
        return not (self.dropped or self.dropped_records)

    def lines(self) -> list[str]:
        out = [f"re-hashed {plural(self.checked, 'blob')} ({format_bytes(self.checked_bytes)}): "
               f"{self.checked - len(self.dropped)} intact, {len(self.dropped)} dropped"
               + (f" (failed the sha256 check or unreadable): {', '.join(self.dropped)}" if self.dropped else "")]
        if self.dropped_records:
            out.append(f"dropped {plural(len(self.dropped_records), 'record')} that named a missing blob: "
                       f"{', '.join(self.dropped_records)}")
        if self.stamps_affected:
            more = len(self.stamps_affected) - 4
            shown = ", ".join(self.stamps_affected[:4]) + (f" and {more} more" if more > 0 else "")
            out.append(f"stamps under build/ naming a blob this cache lacks: {shown} "
                       f"(a build that needs one runs its producer again)")
        return out


def verify(store: Store, project: Path) -> VerifyReport:
    """Re-hash every blob; drop corrupt ones, then every record that names a blob no longer present."""
    names: dict[str, str] = {}
    for _, record in store.actions.records():
        for name, sha in (record.get("outputs") or {}).items():
            names.setdefault(sha, f"{record.get('stage', '?')} {name}")
    report = VerifyReport()
    for entry in store.table.entries("blob:") + store.table.entries("spans:"):
        sha = entry.key.partition(":")[2]
        report.checked += 1
        report.checked_bytes += entry.bytes
        if not store.objects.verify_blob(sha):
            report.dropped.append(f"{sha[:12]} ({names.get(sha, 'no record names it')})")
    report.dropped_records = [f"{stage} ({key[:12]})" for key, stage in _drop_dangling_records(store)]
    for where, stamp in all_stamps(project):
        if any(not store.objects.has_blob(sha) for sha in stamp.outputs.values()):
            report.stamps_affected.append(where)
    return report


# -- stats ---------------------------------------------------------------------------------------

_STATUS = {"cached": "hits", "restored": "restores", "remote": "restores", "ran": "misses"}  # remote: the shared tier


@dataclass
class KindStats:
    hits: int = 0  # up to date in build/
    restores: int = 0  # served from the store
    misses: int = 0  # ran
    saved_seconds: float = 0.0
    saved_bytes: int = 0

    @property
    def total(self) -> int:
        return self.hits + self.restores + self.misses

    @property
    def hit_rate(self) -> Optional[float]:
        return (self.hits + self.restores) / self.total if self.total else None


@dataclass
class Stats:
    usage: dict
    builds: int
    kinds: dict  # stage kind -> KindStats, in build order
    unknown_bytes: int = 0  # served results whose record is no longer in the store
    # Folders stages keep in the cache beside the store (compiled Triton kernels): name -> (files, bytes)
    folders: dict = field(default_factory=dict)
    spans_bytes: int = 0  # what the blobs kept as spans hold (their manifests take usage["spans"])
    # The stages' work folders (ObjectStore.work_folders): (folders, bytes) of running stages, and of
    # killed ones (what `cache gc` and the next build delete).
    work_running: tuple = (0, 0)
    work_left: tuple = (0, 0)

    @property
    def all(self) -> KindStats:
        total = KindStats()
        for k in self.kinds.values():
            for name in ("hits", "restores", "misses", "saved_seconds", "saved_bytes"):
                setattr(total, name, getattr(total, name) + getattr(k, name))
        return total

    def lines(self, root: Path) -> list[str]:
        u = self.usage
        blobs, recs, spanned = u.get("blob", (0, 0)), u.get("rec", (0, 0)), u.get("spans", (0, 0))
        other = [u[k] for k in u if k not in ("blob", "rec", "spans")]
        out = [f"cache {root}: {plural(blobs[0], 'blob')} {format_bytes(blobs[1])}, {plural(recs[0], 'record')} "
               f"{format_bytes(recs[1])}, {plural(sum(c for c, _ in other), 'other entry', 'other entries')} "
               f"{format_bytes(sum(b for _, b in other))} (memo, docs, build log)"]
        if spanned[0]:
            out.append(f"{plural(spanned[0], 'blob')} of {format_bytes(self.spans_bytes)} kept as ranges of the others "
                       f"(manifests of {format_bytes(spanned[1])}): bytes stored once across the files that hold them")
        for name, (files, size) in sorted(self.folders.items()):
            out.append(f"beside it: {name}/ {plural(files, 'file')} {format_bytes(size)}")
        if self.work_running[0]:
            out.append(f"work/: {plural(self.work_running[0], 'folder')} ({format_bytes(self.work_running[1])}) of "
                       "stages running now")
        if self.work_left[0]:
            out.append(f"work/: {plural(self.work_left[0], 'folder')} ({format_bytes(self.work_left[1])}) that killed "
                       "stages left behind; the next build or `cudabuild cache gc` deletes them")
        if not self.builds:
            return out + ["no builds logged yet"]
        out.append(f"last {plural(self.builds, 'build')} (hits: up to date in build/; restores: from the store; misses: ran)")
        out.append(f"  {'stage':<10}{'hits':>6}{'restores':>10}{'misses':>8}{'hit rate':>10}{'time saved':>12}{'bytes saved':>13}")
        for kind, k in list(self.kinds.items()) + [("all", self.all)]:
            rate = f"{k.hit_rate:.0%}" if k.hit_rate is not None else "-"
            out.append(f"  {kind:<10}{k.hits:>6}{k.restores:>10}{k.misses:>8}{rate:>10}"
                       f"{k.saved_seconds:>11.1f}s{format_bytes(k.saved_bytes):>13}")
        a = self.all
        out.append(f"served {a.hits + a.restores} of {a.total} stage results without running them: "
                   f"{a.saved_seconds:.1f}s of run time and {format_bytes(a.saved_bytes)} of artifacts saved"
                   + (f" ({self.unknown_bytes} served results no longer in the store are not counted in bytes)"
                      if self.unknown_bytes else ""))
        return out


def stats(store: Store, last: Optional[int] = None) -> Stats:
    """Counts by stage kind over the last `last` logged builds (all when None)."""
    log = store.actions.build_log(last)
    sizes = {e.key[len("blob:"):]: e.bytes for e in store.table.entries("blob:")}
    spans_bytes = 0
    for entry in store.table.entries("spans:"):  # what a blob kept as spans holds, not its manifest's bytes
        manifest = store.objects.spans_of(entry.key[len("spans:"):])
        if manifest is not None:
            sizes[entry.key[len("spans:"):]] = manifest["size"]
            spans_bytes += manifest["size"]
    records = dict(store.actions.records())
    kinds: dict[str, KindStats] = {}
    unknown = 0
    for build in log:
        for row in build.get("stages", []):
            k = kinds.setdefault(row.get("stage", "?"), KindStats())
            status = _STATUS.get(row.get("status"))
            if status is None:
                continue
            setattr(k, status, getattr(k, status) + 1)
            if status == "misses":
                continue
            k.saved_seconds += row.get("saved_seconds") or 0.0
            record = records.get(row.get("key"))
            if record is None:
                unknown += 1
            else:
                k.saved_bytes += sum(sizes.get(sha, 0) for sha in (record.get("outputs") or {}).values())
    work = store.objects.work_folders()
    running = [size for _, size, alive in work if alive]
    left = [size for _, size, alive in work if not alive]
    return Stats(store.table.usage(), len(log), kinds, unknown, _folders_beside(store.root), spans_bytes,
                 work_running=(len(running), sum(running)), work_left=(len(left), sum(left)))


# The store's own folders (diskcache's, its write area, the build locks, the stages' work folders:
# ObjectStore.work_folders, which gc deletes only when their stage was killed); any other folder in the
# cache root is one a stage keeps there, counted by `cache stats` and gc'd entry by entry.
_STORE_FOLDERS = {"store", "incoming", "locks", "work"}


def _beside(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name not in _STORE_FOLDERS)


def _folders_beside(root: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for folder in _beside(root):
        sizes = [f.stat().st_size for f in folder.rglob("*") if f.is_file()]
        found[folder.name] = (len(sizes), sum(sizes))
    return found

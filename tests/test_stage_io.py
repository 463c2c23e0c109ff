"""cudabuild.engine.stage_io: a stage's upstream outputs are served verified, one path for every
way of reading them; a bad blob sets off what its I/O says (the producer rewound and the read
tried again, or LostInput for the runner that handed the stage over), and so does an output handed
on unchanged that neither tier holds any more."""

from __future__ import annotations

import pickle

import pytest

from cudabuild.engine.graph import Stage
from cudabuild.engine.stage_io import LostInput, StageIO
from cudabuild.engine.stamp import Stamp, Stamps
from cudabuild.engine.store import Store
from cudabuild.errors import CorruptBlob, CudabuildError

PRODUCER, CONSUMER = Stage("export", "decode"), Stage("edge", "decode")


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDABUILD_REMOTE", raising=False)
    s = Store(tmp_path / "cache")
    yield s
    s.close()


def _stamped(stamps: Stamps, store: Store, data: bytes) -> str:
    """The producer's stamp, naming `data` (stored) as its output program.pt."""
    sha = store.objects.put_bytes(data)
    stamps.write(PRODUCER, Stamp(key="k", inputs={}, digest="d", outputs={"program.pt": sha}))
    return sha


def _damage(store: Store, sha: str) -> None:
    path = store.objects.blob_path(sha)
    path.write_bytes(b"not " + path.read_bytes())


def _io(store: Store, tmp_path, rewind=None) -> StageIO:
    stamps = Stamps(tmp_path / "build", "tiny_lm/cpu")
    return StageIO(CONSUMER, (PRODUCER,), stamps, store.objects, store.actions, rewind)


@pytest.mark.parametrize("how", ["read", "path", "file", "fetch", "path_of_sha"])
def test_a_bad_upstream_blob_rewinds_its_producer_and_the_new_one_is_served(store, tmp_path, how):
    rewound = []

    def rewind(stage: Stage) -> None:  # what the runner does: the producer made (here: stored) again
        rewound.append(stage)
        _stamped(io.stamps, store, b"made again")

    io = _io(store, tmp_path, rewind)
    sha = _stamped(io.stamps, store, b"the program")
    _damage(store, sha)
    read = {"read": lambda: io.read(PRODUCER, "program.pt"),
            "path": lambda: io.path(PRODUCER, "program.pt").read_bytes(),
            "fetch": lambda: io.fetch(PRODUCER, "program.pt", tmp_path / "out" / "program.pt").read_bytes(),
            "path_of_sha": lambda: io.path_of_sha(sha).read_bytes()}
    if how == "file":
        with io.file(PRODUCER, "program.pt") as path:
            got = path.read_bytes()
    else:
        got = read[how]()
    assert got == b"made again" and rewound == [PRODUCER]


def test_where_the_stage_cannot_rewind_a_bad_blob_is_a_lost_input_for_its_runner(store, tmp_path):
    io = _io(store, tmp_path)  # no rewind: a warm process's or a cluster worker's
    sha = _stamped(io.stamps, store, b"the program")
    _damage(store, sha)
    with pytest.raises(LostInput) as lost:
        io.read(PRODUCER, "program.pt")
    assert lost.value.producer == PRODUCER and isinstance(lost.value.__cause__, CorruptBlob)
    assert str(lost.value) == str(CorruptBlob(sha))
    again = pickle.loads(pickle.dumps(lost.value))  # as a warm process answers its caller
    assert (type(again), again.producer, str(again)) == (LostInput, PRODUCER, str(lost.value))


def test_an_output_handed_on_that_neither_tier_holds_is_made_again_and_must_be_the_same_bytes(store, tmp_path):
    made = {"bytes": b"the program"}

    def rewind(stage: Stage) -> None:
        _stamped(io.stamps, store, made["bytes"])

    io = _io(store, tmp_path, rewind)
    sha = _stamped(io.stamps, store, b"the program")
    assert io.handed_on({"program.pt": sha}) == {"program.pt": sha}  # held: nothing done
    store.objects.drop_blob(sha)
    assert io.handed_on({"program.pt": sha}) == {"program.pt": sha} and store.objects.has_blob(sha)
    store.objects.drop_blob(sha)
    made["bytes"] = b"other bytes"
    with pytest.raises(CudabuildError, match=rf"^stage edge.decode handed on program.pt of export.decode, which was no "
                                             rf"longer in the cache at .*; made again, it is other bytes"):
        io.handed_on({"program.pt": sha})
    assert _stamped(io.stamps, store, b"the program") == sha
    store.objects.drop_blob(sha)
    with pytest.raises(LostInput) as lost:  # where it cannot be made again here
        _io(store, tmp_path).handed_on({"program.pt": sha})
    assert lost.value.producer == PRODUCER
    with pytest.raises(CudabuildError, match="^stage edge.decode handed on weights.bin, which is no longer in the cache at "):
        io.handed_on({"weights.bin": "f" * 64})  # no upstream stage made it

"""Roll-backs (resume_from) and best checkpoints in the store, on a real local folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore, Writer
from training.config import ConfigError, TrainConfig
from training.start.rollback import pending_roll_back, roll_back

LOSSES = [0.9, 0.5, 0.7, 0.6]  # not monotonic: best-first differs from newest-first
NAMES = [f"ep{i}-ba{8 * i}-sa{256 * i}" for i in range(1, 5)]


def progress(epoch: int) -> dict[str, int]:
    return {"epoch": epoch, "step": 8 * epoch, "samples_seen": 256 * epoch}


def save(store: CheckpointStore, epoch: int, generation: int, loss: float, name: str | None = None) -> str:
    name = name or f"ep{epoch}-ba{8 * epoch}-sa{256 * epoch}"
    store.save(
        name,
        {"state.pt": {"state": {"model": {"w": torch.full((4,), float(epoch))}}}, "rng-rank0.pt": {"epoch": epoch}},
        progress={"epoch": epoch, "step": 8 * epoch, "samples_seen": 256 * epoch},
        metadata={"metrics": {"loss": loss}},
        writer=Writer.current(generation),
    )
    return name


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    """A run of four units, all written by writer generation 1."""
    store = CheckpointStore(str(tmp_path / "runs"), "r")
    for epoch, loss in enumerate(LOSSES, start=1):
        save(store, epoch, 1, loss)
    return store


def files_under(folder: str) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


def config(store: CheckpointStore, **values) -> TrainConfig:
    return TrainConfig(run_name="r", save_folder=store.uri.rsplit("/", 1)[0], **values)


def test_a_roll_back_sets_later_checkpoints_aside_without_deleting_them(store):
    set_aside = store.roll_back(NAMES[1], Writer.current(2))

    assert set_aside == NAMES[2:]
    assert store.latest().name == NAMES[1]
    assert [i.name for i in store.candidates()] == NAMES[1::-1]
    assert [i.name for i in store.list()] == NAMES  # still there, manifests and all
    assert all(store.check(n, deep=True) == [] for n in NAMES)
    assert store.set_aside() == NAMES[2:]
    # the state a unit restores (training.unit.session uses load_latest) is the roll-back's target
    loaded = store.load_latest(["state.pt"])
    assert loaded.info.name == NAMES[1]
    assert torch.equal(loaded.objects["state.pt"]["state"]["model"]["w"], torch.full((4,), 2.0))


def test_checkpoints_written_after_a_roll_back_are_candidates_again(store):
    store.roll_back(NAMES[1], Writer.current(2))
    again = save(store, 3, 2, 0.4, name=store.name_for(progress(3), 2))

    assert again == f"{NAMES[2]}-g2"  # the set-aside ep3 keeps its name
    assert store.latest().name == again
    assert store.set_aside() == NAMES[2:]


def test_best_is_best_first_and_leaves_out_what_a_roll_back_set_aside(store):
    assert [i.name for i in store.best("loss", "min")] == [NAMES[1], NAMES[3], NAMES[2], NAMES[0]]
    assert [i.name for i in store.best("loss", "max")] == [NAMES[0], NAMES[2], NAMES[3], NAMES[1]]
    store.roll_back(NAMES[0], Writer.current(2))
    assert [i.name for i in store.best("loss", "min")] == [NAMES[0]]
    assert store.best("accuracy") == []


def test_resume_from_a_name_the_run_does_not_have_fails_before_anything_is_written(store):
    before = files_under(store.uri)
    with pytest.raises(ConfigError, match=r"^resume_from='ep9-ba72-sa2304': run 'r' in .* has no checkpoint of that"):
        pending_roll_back(config(store, resume_from="ep9-ba72-sa2304"), store)
    assert files_under(store.uri) == before


def test_resume_from_a_checkpoint_with_a_truncated_file_fails_before_anything_is_written(store):
    key = f"checkpoints/{NAMES[1]}/state.pt"
    store.storage.put(key, store.storage.get(key)[:-1])
    before = files_under(store.uri)
    with pytest.raises(ConfigError, match=rf"^resume_from='{NAMES[1]}': that checkpoint does not verify \(.*size"):
        pending_roll_back(config(store, resume_from=NAMES[1]), store)
    assert files_under(store.uri) == before


def test_a_checkpoint_a_roll_back_set_aside_cannot_be_rolled_back_to(store):
    store.roll_back(NAMES[1], Writer.current(2))
    before = files_under(store.uri)
    with pytest.raises(ConfigError, match=rf"^resume_from='{NAMES[3]}': an earlier roll-back set that checkpoint"):
        pending_roll_back(config(store, resume_from=NAMES[3]), store)
    with pytest.raises(ValueError, match=rf"^resume_from='{NAMES[3]}': an earlier roll-back set that checkpoint"):
        store.roll_back(NAMES[3], Writer.current(3))
    assert files_under(store.uri) == before
    assert store.latest().name == NAMES[1]


def test_resume_from_applies_once_and_again_after_a_roll_back_elsewhere(store):
    wanted = config(store, resume_from=NAMES[1])
    assert pending_roll_back(wanted, store) == NAMES[1]
    roll_back(store, NAMES[1], store.claim_generation())
    save(store, 3, 2, 0.4, name=store.name_for(progress(3), 2))

    # a relaunch (or a crash-restarted flow run) with the same resume_from keeps what was trained since
    assert pending_roll_back(wanted, store) is None
    assert store.latest().name == f"{NAMES[2]}-g2"
    # a roll-back to another checkpoint in between (a later one: an earlier one sets this one aside) makes the
    # same resume_from apply again
    save(store, 4, 2, 0.3, name=store.name_for(progress(4), 2))
    roll_back(store, f"{NAMES[2]}-g2", store.claim_generation())
    assert pending_roll_back(wanted, store) == NAMES[1]
    roll_back(store, NAMES[1], store.claim_generation())
    assert store.latest().name == NAMES[1]


def test_resume_from_must_be_a_checkpoint_name_and_continues_the_run():
    with pytest.raises(ValueError, match=r"resume_from='../other/ep1': use 1-128 letters"):
        TrainConfig(resume_from="../other/ep1")
    with pytest.raises(ValueError, match=r"resume_from='ep1' continues the run .* autoresume=False"):
        TrainConfig(resume_from="ep1", autoresume=False)

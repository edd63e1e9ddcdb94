"""The sample order: independent of batch and world size, resumable at any sample, O(1) to seek."""

from __future__ import annotations

import functools
import operator

from hypothesis import given, settings
from hypothesis import strategies as st

from training.config import Duration
from training.position.progress import Progress, ends_unit, rescaled, samples_left
from training.position.sampler import ResumableBatchSampler, epoch_order


def consume(num_samples: int, segments: list[tuple[int, int]], seed: int = 3, world_size: int = 1) -> list[int]:
    """Trains ``steps`` batches of size ``gbs`` per segment, stopping and resuming between segments."""
    p, seen = Progress(), []
    for gbs, steps in segments:
        p = rescaled(p, gbs) if p.global_batch_size else Progress(global_batch_size=gbs)
        while steps > 0:
            sampler = ResumableBatchSampler(num_samples, gbs, seed=seed, epoch=p.epoch, start=p.sample_in_epoch)
            for ids in sampler:
                shares = [
                    ResumableBatchSampler(
                        num_samples,
                        gbs,
                        seed=seed,
                        epoch=p.epoch,
                        start=p.sample_in_epoch,
                        rank=r,
                        world_size=world_size,
                    )
                    for r in range(world_size)
                ]
                first = [next(s.shares()) for s in shares]
                assert sorted(functools.reduce(operator.iadd, (share for share, _ in first), [])) == sorted(
                    ids
                )  # ranks split the batch
                assert all(size == len(ids) for _, size in first)
                seen += ids
                p.advance(len(ids), num_samples)
                steps -= 1
                if steps == 0 or p.sample_in_epoch == 0:
                    break
    return seen


@settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 300),
    segments=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 40)), min_size=1, max_size=6),
    world_size=st.sampled_from([1, 2, 3]),
)
def test_any_sequence_of_batch_sizes_and_stops_sees_every_sample_once_per_epoch(num_samples, segments, world_size):
    seen = consume(num_samples, segments, world_size=world_size)
    full_epochs, rest = divmod(len(seen), num_samples)
    for e in range(full_epochs):
        assert sorted(seen[e * num_samples : (e + 1) * num_samples]) == list(range(num_samples))
    tail = seen[full_epochs * num_samples :]
    assert len(set(tail)) == len(tail) == rest


def test_order_depends_on_seed_and_epoch_but_not_batch_size():
    a = [i for b in ResumableBatchSampler(100, 7, seed=1, epoch=2) for i in b]
    b = [i for b in ResumableBatchSampler(100, 33, seed=1, epoch=2) for i in b]
    assert a == b == epoch_order(100, 1, 2).tolist()
    assert a != epoch_order(100, 1, 3).tolist()
    assert a != epoch_order(100, 2, 2).tolist()


def test_seek_starts_exactly_at_the_saved_sample():
    order = epoch_order(1000, 5, 0).tolist()
    resumed = [i for b in ResumableBatchSampler(1000, 64, seed=5, epoch=0, start=333) for i in b]
    assert resumed == order[333:]


def test_without_shuffle_samples_come_in_id_order():
    assert [i for b in ResumableBatchSampler(10, 4, seed=1, epoch=0, shuffle=False) for i in b] == list(range(10))


def test_batch_size_change_continues_the_step_counter_from_samples_seen():
    p = Progress(epoch=0, step=5, samples_seen=160, sample_in_epoch=160, global_batch_size=32)
    q = rescaled(p, 48)
    assert (q.step, q.samples_seen, q.sample_in_epoch, q.global_batch_size) == (3, 160, 160, 48)
    assert rescaled(p, 32) == p


def test_unit_boundaries_follow_save_interval_and_max_duration():
    p = Progress(epoch=0, step=4, samples_seen=128, sample_in_epoch=128, global_batch_size=32)
    assert ends_unit(p, Duration(2, "ba"), Duration(3, "ep"), epoch_ended=False, batch_samples=32)
    assert not ends_unit(p, Duration(3, "ba"), Duration(3, "ep"), epoch_ended=False, batch_samples=32)
    assert ends_unit(p, Duration(1, "ep"), Duration(4, "ba"), epoch_ended=False, batch_samples=32)  # end of training
    assert not ends_unit(p, Duration(1, "ep"), Duration(9, "ba"), epoch_ended=False, batch_samples=32)
    # In samples: the step that crosses a multiple of the interval closes the unit; the end is exact.
    assert ends_unit(p, Duration(100, "sp"), Duration(3, "ep"), epoch_ended=False, batch_samples=32)  # 96 -> 128
    assert not ends_unit(p, Duration(80, "sp"), Duration(3, "ep"), epoch_ended=False, batch_samples=32)  # 96 -> 128
    assert ends_unit(p, Duration(128, "sp"), Duration(3, "ep"), epoch_ended=False, batch_samples=32)
    assert ends_unit(p, Duration(1, "ep"), Duration(128, "sp"), epoch_ended=False, batch_samples=32)


def test_a_duration_in_samples_cuts_the_last_batch_to_fit():
    p = Progress(epoch=0, step=3, samples_seen=96, sample_in_epoch=96, global_batch_size=32)
    assert samples_left(p, Duration(150, "sp")) == 54
    assert samples_left(p, Duration(3, "ep")) is None
    sampler = ResumableBatchSampler(200, 32, seed=0, epoch=0, start=96, stop=96 + 54)
    assert [n for _, n in sampler.shares()] == [32, 22]
    assert len(sampler) == 2
    assert sum(len(ids) for ids in sampler) == 54


def test_a_rank_with_no_sample_in_the_short_last_batch_loads_a_stand_in_but_reports_none():
    # 65 samples, batches of 32 over 2 ranks: the last batch has one sample, so rank 1's share is empty.
    rank1 = ResumableBatchSampler(65, 32, seed=0, epoch=0, rank=1, world_size=2)
    shares, loaded = list(rank1.shares()), list(rank1)
    assert shares[-1] == ([], 1)
    assert len(loaded) == len(shares) == 3 and len(loaded[-1]) == 1  # still takes part in the step

"""Progress counters in samples, so a data position survives any change of batch or world size."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from training.config import ConfigError, Duration

MAX_COUNT = 2**53  # past this no run counts (and a JSON number stops being exact)


@dataclass
class Progress:
    """Where training stands. ``sample_in_epoch`` indexes the epoch's sample order, not a batch."""

    epoch: int = 0  # completed epochs
    step: int = 0  # optimizer steps taken (continued as samples_seen // batch after a resize)
    samples_seen: int = 0  # samples trained on, over all epochs and processes
    sample_in_epoch: int = 0  # position in the current epoch's order
    global_batch_size: int = 0  # the size these counters were reached with

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> Progress:
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__ if k in d})

    def advance(self, num_samples: int, epoch_size: int) -> bool:
        """Counts one optimizer step of ``num_samples``; returns True when it finished the epoch."""
        self.step += 1
        self.samples_seen += num_samples
        self.sample_in_epoch += num_samples
        if self.sample_in_epoch >= epoch_size:
            self.epoch += 1
            self.sample_in_epoch = 0
            return True
        return False


def check_progress(p: Progress, epoch_size: int, what: str, fix: str, *, skipped: bool = False) -> None:
    """Counters a checkpoint carries into a run place it in this run's data, else one ConfigError naming the counter
    (before anything is claimed, rather than the sampler's ValueError at the first step): each at most MAX_COUNT; the
    position in the epoch inside an epoch of ``epoch_size`` samples (0: not known here) and, unless a data skip moved
    it ahead (``skipped``: the checkpoint records one), not past the samples seen."""
    counts = p.as_dict()
    big = next((k for k, v in counts.items() if not 0 <= v <= MAX_COUNT), None)
    if big is not None:
        problem = f"{big}={counts[big]} is outside 0..{MAX_COUNT}"
    elif epoch_size and p.sample_in_epoch >= epoch_size:
        problem = (
            f"sample_in_epoch={p.sample_in_epoch} is past the end of an epoch of this run's data ({epoch_size} samples)"
        )
    elif not skipped and p.sample_in_epoch > p.samples_seen:
        problem = f"sample_in_epoch={p.sample_in_epoch} is more than samples_seen={p.samples_seen}, the samples trained"
    else:
        return
    raise ConfigError(f"{what}: its progress does not fit: {problem}; {fix}")


def rescaled(p: Progress, global_batch_size: int) -> Progress:
    """The same position counted in batches of a new size: the step counter continues at
    ``samples_seen // global_batch_size`` (never rounded up, so no step is skipped)."""
    if not p.global_batch_size or p.global_batch_size == global_batch_size:
        return Progress(p.epoch, p.step, p.samples_seen, p.sample_in_epoch, global_batch_size)
    return Progress(p.epoch, p.samples_seen // global_batch_size, p.samples_seen, p.sample_in_epoch, global_batch_size)


def _count(p: Progress, unit: str) -> int:
    return {"ep": p.epoch, "ba": p.step, "sp": p.samples_seen}[unit]


def is_complete(p: Progress, duration: Duration) -> bool:
    return _count(p, duration.unit) >= duration.value


def is_past(p: Progress, duration: Duration) -> bool:
    """Trained beyond ``duration`` (not merely up to it): a later model than the one asked for."""
    if duration.unit == "ep":
        return p.epoch > duration.value or (p.epoch == duration.value and p.sample_in_epoch > 0)
    return _count(p, duration.unit) > duration.value


def at(p: dict[str, int], duration: Duration) -> bool:
    """Whether progress counters ``p`` (a manifest's) sit exactly at the end of ``duration``."""
    if duration.unit == "ep":
        return p.get("epoch") == duration.value and p.get("sample_in_epoch", 0) == 0
    return p.get({"ba": "step", "sp": "samples_seen"}[duration.unit]) == duration.value


def unit_index(p: Progress, interval: Duration) -> int:
    """Number of the unit that starts at ``p`` (0-based)."""
    return _count(p, interval.unit) // interval.value


def samples_left(p: Progress, duration: Duration) -> int | None:
    """Samples until a duration in samples ends (None for other units): the last batch is cut to fit."""
    return max(duration.value - p.samples_seen, 0) if duration.unit == "sp" else None


def ends_unit(p: Progress, interval: Duration, duration: Duration, epoch_ended: bool, batch_samples: int) -> bool:
    """Whether the step just counted (of ``batch_samples``) closes a unit: a save_interval boundary or the end."""
    return is_complete(p, duration) or crossed(p, interval, epoch_ended, batch_samples)


def crossed(p: Progress, interval: Duration, epoch_ended: bool, batch_samples: int) -> bool:
    """Whether the step just counted (of ``batch_samples``) reached a multiple of ``interval``."""
    if interval.unit == "ba":
        return p.step % interval.value == 0
    if interval.unit == "sp":  # the step that crosses a multiple of the interval closes the unit
        return p.samples_seen // interval.value > (p.samples_seen - batch_samples) // interval.value
    return epoch_ended and p.epoch % interval.value == 0

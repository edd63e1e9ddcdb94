"""Progress counters in samples, so a data position survives any change of batch or world size."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from training.config import Duration


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


def rescaled(p: Progress, global_batch_size: int) -> Progress:
    """The same position counted in batches of a new size: the step counter continues at
    ``samples_seen // global_batch_size`` (never rounded up, so no step is skipped)."""
    if not p.global_batch_size or p.global_batch_size == global_batch_size:
        return Progress(p.epoch, p.step, p.samples_seen, p.sample_in_epoch, global_batch_size)
    return Progress(p.epoch, p.samples_seen // global_batch_size, p.samples_seen, p.sample_in_epoch, global_batch_size)


def is_complete(p: Progress, duration: Duration) -> bool:
    if duration.unit == "ep":
        return p.epoch >= duration.value
    return p.step >= duration.value


def unit_index(p: Progress, interval: Duration) -> int:
    """Number of the unit that starts at ``p`` (0-based)."""
    return p.epoch // interval.value if interval.unit == "ep" else p.step // interval.value


def ends_unit(p: Progress, interval: Duration, duration: Duration, epoch_ended: bool) -> bool:
    """Whether the step just counted closes a unit: a save_interval boundary or the end of training."""
    if is_complete(p, duration):
        return True
    if interval.unit == "ba":
        return p.step % interval.value == 0
    return epoch_ended and p.epoch % interval.value == 0

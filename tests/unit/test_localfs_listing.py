"""A listing of a local folder is of what exists while it is read: an entry that goes away between the folder's read
and its own ``stat`` (a temporary file renamed into place by a writer, a folder removed) is left out, and the walk goes
on. Before, that FileNotFoundError ended the walk and a partial listing came back as if whole: a sweep's ledger
read then reported "00000001.json: missing, while 00000003.json exists" (checkpointing/io/localfs.py ``sizes``)."""

from __future__ import annotations

import os
import shutil

from checkpointing.io import localfs
from checkpointing.io.localfs import LocalFiles


def test_entries_that_vanish_mid_listing_are_left_out_and_the_rest_is_listed(tmp_path, monkeypatch):
    outside, tmp_path = tmp_path, tmp_path / "run"
    tmp_path.mkdir()
    for name in ("a", "b.tmp", "c", "e"):
        (tmp_path / name).write_bytes(b"x" * len(name))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"ffff")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "h").write_bytes(b"hh")
    real_scandir = os.scandir

    class Vanishing:
        """os.scandir of the top folder, removing b.tmp and d just before their entries are handed out (as a writer
        renaming b.tmp and a cleaner removing d would, after the folder's entries were read)."""

        def __init__(self, fd):
            self.inner = real_scandir(fd)
            self.entries = iter(sorted(self.inner, key=lambda e: e.name))  # in name order: b.tmp before c, d before e
            self.top = fd == top[0]

        def __iter__(self):
            return self

        def __next__(self):
            entry = next(self.entries)
            if self.top and entry.name == "b.tmp":
                os.rename(tmp_path / "b.tmp", outside / "b-renamed")
            if self.top and entry.name == "d":
                shutil.rmtree(tmp_path / "d")
            return entry

        def close(self):
            self.inner.close()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    top: list[int] = []
    real_walk = LocalFiles._walk

    def walk(self, folder, found, where):
        top.append(folder)
        return real_walk(self, folder, found, where)

    monkeypatch.setattr(localfs.os, "scandir", Vanishing)
    monkeypatch.setattr(LocalFiles, "_walk", walk)

    listed = LocalFiles(str(tmp_path)).sizes("")

    assert listed == {"a": 1, "c": 1, "e": 1, "g/h": 2}

"""Other tools' shard formats as ``ShardedDataset`` formats (training/data/formats/): MosaicML MDS as the real
``streaming.MDSWriter`` writes it (committed fixtures, tests/fixtures/mds/make_fixture.py) and WebDataset tars as the
real ``webdataset.ShardWriter`` writes them, read back equal on a local folder and on S3 (moto); batch and world size
changes over their order; hostile shards one DataError each."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest

from tests.format_data import MDS_FIXTURES, MDS_RAW_SAMPLES, MDS_SAMPLES, mds_sample, plain, tar_bytes, write_wds
from training.data import ShardedDataset
from training.exceptions import DataError
from training.position.sampler import ResumableBatchSampler

WDS_SAMPLES = 130


def upload(local: Path, url: str, options: dict | None) -> str:
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.makedirs(root, exist_ok=True)
    for f in sorted(local.iterdir()):
        fs.pipe_file(f"{root}/{f.name}", f.read_bytes())
    return url


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """(url of a fresh folder, storage options) on a local folder, then on S3 over HTTP."""
    if request.param == "local":
        return str(tmp_path / "data"), None
    folder, options = request.getfixturevalue("s3")
    return f"{folder.rsplit('/', 1)[0]}/data", options


def mds(tmp_path, name="zstd") -> str:
    shutil.copytree(MDS_FIXTURES / name, tmp_path / name)
    return str(tmp_path / name)


def wds_folder(tmp_path) -> Path:
    write_wds(tmp_path / "wds", WDS_SAMPLES)
    return tmp_path / "wds"


# -- every sample back, equal ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,n", [("zstd", MDS_SAMPLES), ("raw", MDS_RAW_SAMPLES)])
def test_mds_written_by_mdswriter_reads_back_every_sample_equal_in_mds_order(store, name, n):
    url, options = store
    upload(MDS_FIXTURES / name, url, options)
    ds = ShardedDataset(url, "mds", storage_options=options)
    assert len(ds) == n and len(ds.index.shards) > 3  # several shards, of MDSWriter's own sizes
    got = ds.__getitems__(list(range(n)))
    assert [plain(s) for s in got] == [plain(mds_sample(g)) for g in range(n)]
    assert type(got[5]["id"]) is int and got[5]["f32"].dtype == np.float32 and got[5]["img"].mode == "RGB"
    if name == "zstd":  # StreamingDataset leaves unpacked copies beside the shards it read: they are not shards
        import zstandard

        fs, root = fsspec.core.url_to_fs(url, **(options or {}))
        packed = (MDS_FIXTURES / name / "shard.00000.mds.zstd").read_bytes()
        fs.pipe_file(f"{root}/shard.00000.mds", zstandard.ZstdDecompressor().decompressobj().decompress(packed))
        assert len(ShardedDataset(url, "mds", storage_options=options)) == n


def test_webdataset_written_by_shardwriter_reads_back_as_webdataset_reads_it(store, tmp_path):
    import webdataset as wds

    local = wds_folder(tmp_path)
    url, options = store
    upload(local, url, options)
    ds = ShardedDataset(url, "webdataset", storage_options=options)
    theirs = list(wds.WebDataset([str(p) for p in sorted(local.glob("*.tar"))], shardshuffle=False).decode("pil"))
    assert len(ds) == len(theirs) == WDS_SAMPLES and len(ds.index.shards) == 3
    assert [plain(ds[i]) for i in range(len(ds))] == [plain(s) for s in theirs]
    assert ds[7]["cls"] == 7 and ds[7]["tokens.npy"].tolist() == [7] * 9 and ds[7]["txt"] == "sample 7 é"


def test_samples_grouped_by_key_as_webdataset_groups_them(tmp_path):
    import webdataset as wds

    members = [("a/x.1.txt", b"one", "file"), ("a/x.1.JSON", b"[1]", "file"), ("__meta__/k.txt", b"m", "file"),
               ("a", None, "dir"), ("a/x.2.txt", b"two", "file"), ("noext", b"?", "file"), ("b/x.1.txt", b"b", "file")]  # fmt: skip
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "s.tar").write_bytes(tar_bytes(members))
    ds = ShardedDataset(str(tmp_path / "t"), "webdataset")
    theirs = list(wds.WebDataset([str(tmp_path / "t" / "s.tar")], shardshuffle=False).decode())
    assert [plain(ds[i]) for i in range(len(ds))] == [plain(s) for s in theirs]
    assert [s["__key__"] for s in theirs] == ["a/x", "b/x"] and ds[0]["1.json"] == [1]


# -- the position: batch and world size changes, read back from the data --------------------------------------------------
@pytest.mark.parametrize("fmt", ["mds", "webdataset"])
def test_batch_and_world_size_changes_over_their_order_feed_each_sample_once(tmp_path, fmt):
    url = mds(tmp_path) if fmt == "mds" else str(wds_folder(tmp_path))
    ds = ShardedDataset(url, fmt, shuffle_window=2)
    n, seen, position = len(ds), [], 0
    for world, batch, steps in [(2, 32, 3), (1, 48, 2), (2, 16, 100)]:  # gbs 32 -> 48 -> 16, world 2 -> 1 -> 2
        for _ in range(steps):
            if position == n:
                break
            shares = [
                ResumableBatchSampler(
                    n, batch, seed=5, epoch=0, start=position, rank=r, world_size=world, order=ds.epoch_order
                )
                for r in range(world)
            ]
            ids = [i for s in shares for i in next(iter(s.shares()))[0]]
            column = "tokens" if fmt == "mds" else "tokens.npy"
            seen += [int(s[column][0]) for s in ds.__getitems__(ids)]  # which sample, from the data itself
            position += len(ids)
    assert sorted(seen) == list(range(n)) and seen != sorted(seen)  # each once, in the windowed shuffle's order


# -- untrusted shards ----------------------------------------------------------------------------------------------------
def test_a_pkl_column_an_unknown_encoding_or_a_forged_count_is_refused_before_any_sample(tmp_path):
    url = mds(tmp_path)
    index = json.loads((tmp_path / "zstd" / "index.json").read_text())
    for encoding, said in [("pkl", "only unpickling reads"), ("list[pil]", "does not decode")]:
        changed = json.loads(json.dumps(index))
        changed["shards"][3]["column_encodings"][2] = encoding
        (tmp_path / "zstd" / "index.json").write_text(json.dumps(changed))
        with pytest.raises(DataError, match=rf"index.json: column 'i16' .*{said}"):
            ShardedDataset(url, "mds")
    forged = json.loads(json.dumps(index))
    forged["shards"][0]["samples"] = 10**12  # more than its bytes could hold offsets for
    (tmp_path / "zstd" / "index.json").write_text(json.dumps(forged))
    with pytest.raises(DataError, match=r"index.json: a shard of \d+ bytes declares 1000000000000 samples"):
        ShardedDataset(url, "mds")
    assert not (tmp_path / "zstd" / "shards.index.json").exists()  # nothing written


def test_a_damaged_mds_shard_is_one_error_naming_it(tmp_path):
    url = mds(tmp_path, "raw")
    shard = tmp_path / "raw" / "shard.00001.mds"
    data = bytearray(shard.read_bytes())
    data[4 + 4 * 5 : 4 + 4 * 6] = (10**6).to_bytes(4, "little")  # an offset past the end, before the first open
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard.00001.mds: its sample offsets"):
        ShardedDataset(url, "mds")[9]
    packed = tmp_path / "zs"
    shutil.copytree(MDS_FIXTURES / "zstd", packed)
    bad = packed / "shard.00002.mds.zstd"
    bad.write_bytes(b"\0" * bad.stat().st_size)  # same size, not zstd
    with pytest.raises(DataError, match=r"shard.00002.mds.zstd: not zstd data"):
        ShardedDataset(str(packed), "mds")[80]
    index = json.loads((packed / "index.json").read_text())
    index["shards"][5]["raw_data"]["bytes"] = 200  # it unpacks to more than index.json says: stopped at 201 bytes
    (packed / "index.json").write_text(json.dumps(index))
    os.unlink(packed / "shards.index.json")
    with pytest.raises(DataError, match=r"shard.00005.mds.zstd: unpacks to 201 bytes or more, index.json says 200"):
        ShardedDataset(str(packed), "mds")[200]
    os.unlink(packed / "shard.00004.mds.zstd")
    os.symlink(bad, packed / "shard.00004.mds.zstd")
    with pytest.raises(DataError, match=r"shard.00004.mds.zstd is a link"):
        ShardedDataset(str(packed), "mds")


@pytest.mark.parametrize(
    "members,said",
    [
        ([("k.txt", b"a", "file"), ("k.jpg", None, "symlink")], r"member 'k.jpg' is a link"),
        ([("k.txt", b"a", "file"), ("k.TXT", b"b", "file")], r"sample 'k' has two members named 'txt'"),
        ([("k.bin", b"x" * 2000, "file")], r"member 'k.bin' is 2000 bytes, more than max_sample_bytes=1000"),
    ],
)
def test_a_hostile_tar_is_one_error_naming_it(tmp_path, members, said):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "s.tar").write_bytes(tar_bytes(members))
    with pytest.raises(DataError, match=rf"s.tar: {said}"):
        ShardedDataset(str(tmp_path / "t"), "webdataset", max_sample_bytes=1000)
    assert not (tmp_path / "t" / "shards.index.json").exists()


def test_a_tar_cut_short_or_changed_is_one_error_naming_it(tmp_path):
    local = wds_folder(tmp_path)
    ds = ShardedDataset(str(local), "webdataset")
    tar = local / "part-0001.tar"
    data = tar.read_bytes()
    tar.write_bytes(data[: len(data) // 2] + b"\0" * (len(data) - len(data) // 2))  # same size, half its samples
    with pytest.raises(DataError, match=r"part-0001.tar: .*(rewritten with other content|the index says 45)"):
        ds[50]  # the index's content fingerprint, or the reader's count where an index has none
    tar.write_bytes(b"\1" * len(data))  # garbage from its first header on, before an index was written
    os.unlink(local / "shards.index.json")
    with pytest.raises(
        DataError, match=r"part-0001.tar: not a tar file tarfile reads \(ReadError\); restore the shard"
    ):
        ShardedDataset(str(local), "webdataset")

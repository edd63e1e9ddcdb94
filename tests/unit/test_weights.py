"""Weights files from anywhere: every layout other tools write, on local, memory:// and S3 over HTTP (moto),
loaded without running code, refused in one line when hostile or mismatched."""

from __future__ import annotations

import os
import threading

import pytest
import safetensors.torch
import torch

from checkpointing import UnsafeCheckpointError
from checkpointing.peers.formats import is_weights_file, read_weights
from checkpointing.peers.weights import WeightsError, load_into
from recipes.synthetic import SyntheticRecipe
from tests.interop_stores import STORES, put, store_root, torch_bytes


def model(**args) -> torch.nn.Module:
    torch.manual_seed(args.pop("seed", 0))
    return SyntheticRecipe(**args).build_model()


@pytest.fixture
def source() -> dict[str, torch.Tensor]:
    return model(seed=1).state_dict()


def prefixed(sd: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in sd.items()}


LAYOUTS = {
    "plain state_dict": lambda sd: torch_bytes(sd),
    "our export": lambda sd: torch_bytes({"model": sd, "metadata": {"recipe": "recipes.synthetic:SyntheticRecipe"}}),
    "composer": lambda sd: torch_bytes({"state": {"model": sd, "optimizers": {}}, "rng": []}),
    "lightning": lambda sd: torch_bytes({"state_dict": prefixed(sd, "model."), "epoch": 3}),
    "ddp prefix": lambda sd: torch_bytes(prefixed(sd, "module.")),
    "torch.compile prefix": lambda sd: torch_bytes(prefixed(sd, "_orig_mod.")),
    "safetensors": lambda sd: safetensors.torch.save(sd),
}


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_loads_weights_equal_to_the_source(kind, layout, source, request, tmp_path):
    root, options = store_root(kind, request, tmp_path)
    uri = f"{root}/weights.{'safetensors' if layout == 'safetensors' else 'pt'}"
    put(uri, LAYOUTS[layout](source), options)

    assert is_weights_file(uri, options)
    weights = read_weights(uri, options)
    target = model(seed=2)
    report = load_into(target, weights.state_dict)

    assert report.ok and len(report.loaded) == len(source)
    for key, value in target.state_dict().items():
        assert torch.equal(value, source[key]), key


def test_a_wrapper_prefix_is_stripped_only_when_it_wraps_every_key(source):
    report = load_into(model(seed=2), prefixed(prefixed(source, "_orig_mod."), "module."))
    assert report.stripped_prefix == "module._orig_mod."
    mixed = {**prefixed(source, "module."), "extra": torch.zeros(1)}
    with pytest.raises(WeightsError, match="no key of the file matches the model"):  # even when not strict
        load_into(model(seed=2), mixed, strict=False)


@pytest.mark.parametrize("kind", STORES)
def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(kind, request, tmp_path):
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    root, options = store_root(kind, request, tmp_path)
    put(f"{root}/evil.pt", torch_bytes({"model": Payload()}), options)

    with pytest.raises(UnsafeCheckpointError) as info:
        read_weights(f"{root}/evil.pt", options)
    assert str(info.value).startswith(f"load_path='{root}/evil.pt': refused: the file needs code to load (")
    assert "a type outside the allow-list of harmless types" in str(info.value)
    assert "posix" not in str(info.value) and "touch" not in str(info.value)  # names the problem, never the content
    assert "\n" not in str(info.value)
    assert not marker.exists()


def _read_in_thread(uri: str) -> BaseException | None:
    """read_weights in a thread: a FIFO or /dev/zero must be refused at once, never block or stream forever."""
    outcome: list[BaseException | None] = []

    def target():
        try:
            read_weights(uri)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), f"reading {uri} blocked"
    return outcome[0]


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda p: os.mkfifo(p), "a FIFO"),
        (lambda p: os.symlink("/dev/zero", p), "a character device"),
        (lambda p: (os.mkfifo(f"{p}.fifo"), os.symlink(f"{p}.fifo", p)), "a FIFO"),
    ],
    ids=["fifo", "symlink to /dev/zero", "symlink to a fifo"],
)
def test_a_local_path_that_is_not_a_regular_file_is_refused_without_blocking(make, kind, tmp_path):
    path = str(tmp_path / "weights.pt")
    make(path)
    assert is_weights_file(path)
    exc = _read_in_thread(path)
    assert isinstance(exc, WeightsError)
    assert str(exc) == (
        f"load_path={path!r}: not a regular file ({kind}); refusing to read it: name a weights file or a checkpoint folder"
    )


def test_a_symlink_to_a_regular_weights_file_is_read(source, tmp_path):
    # Hugging Face's cache links snapshot files to blobs: a link to a regular file is an ordinary weights file.
    (tmp_path / "blob").write_bytes(safetensors.torch.save(source))
    os.symlink(tmp_path / "blob", tmp_path / "model.safetensors")
    weights = read_weights(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(weights.state_dict[k], v) for k, v in source.items())


@pytest.mark.parametrize("kind", STORES)
def test_a_file_larger_than_the_bound_is_refused_before_it_is_read(kind, source, request, tmp_path):
    root, options = store_root(kind, request, tmp_path)
    data = torch_bytes(source)
    put(f"{root}/big.pt", data, options)
    with pytest.raises(WeightsError) as info:
        read_weights(f"{root}/big.pt", options, max_bytes=len(data) - 1)
    assert str(info.value).startswith(f"load_path='{root}/big.pt': 0.00 GB is more than this worker loads")


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not weights at all", "neither a torch.save file, a safetensors file nor a MindSpore checkpoint"),
        (torch_bytes({"epoch": 3, "note": "no tensors"}), "holds no state_dict in a layout this reader knows"),
        (b"", "the file is empty"),
    ],
    ids=["garbage", "no state_dict", "empty"],
)
def test_a_file_that_holds_no_weights_is_refused_in_one_line(data, message, tmp_path):
    path = tmp_path / "x.pt"
    path.write_bytes(data)
    with pytest.raises(WeightsError) as info:
        read_weights(str(path))
    assert message in str(info.value) and "\n" not in str(info.value)
    problem = str(info.value).split(": ", 1)[1]
    assert "not weig" not in problem and "note" not in problem and "epoch" not in problem  # never its bytes or keys


def test_a_missing_file_says_so(tmp_path):
    path = str(tmp_path / "nope.safetensors")
    assert is_weights_file(path)  # named like weights: the error should be about the file, not about folders
    with pytest.raises(WeightsError, match="no such file"):
        read_weights(path)


def test_folders_are_not_weights_files(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert not is_weights_file(str(tmp_path / "run"))
    assert not is_weights_file(str(tmp_path / "run/checkpoints/ep1/manifest.json"))
    assert not is_weights_file(str(tmp_path / "not-yet-a-run"))


def test_strict_mismatch_is_one_line_naming_keys_shapes_and_the_fix(source):
    wider = model(hidden=8)  # layers 0 and 3 change shape
    with pytest.raises(WeightsError) as info:
        load_into(wider, source, where="load_path='w.pt'")
    assert str(info.value) == (
        "load_path='w.pt': the weights do not match the model: 3 of another shape ('0.bias' file [32] vs model [8], "
        "'0.weight' file [32, 16] vs model [8, 16], '3.weight' file [4, 32] vs model [4, 8]); set "
        "load_strict=false to load the keys that match, or load_ignore_keys=['0.*'] to leave keys out"
    )


def test_strict_mismatch_names_the_first_missing_and_unexpected_keys(source):
    deeper = model(num_layers=3)  # keys 0, 3, 6: the file has 0 and 3 (3 of another shape), not 6
    renamed = {("head." + k if k.startswith("3.") else k): v for k, v in source.items()}
    with pytest.raises(WeightsError) as info:
        load_into(deeper, renamed)
    message = str(info.value)
    assert "4 missing from the file ('3.bias', '3.weight', '6.bias', ...)" in message
    assert "2 not in the model ('head.3.bias', 'head.3.weight')" in message


def test_non_strict_loads_what_matches_and_leaves_the_rest_initialized(source):
    target = model(num_classes=5, seed=3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    report = load_into(target, source, strict=False)

    assert report.loaded == ["0.bias", "0.weight"] and report.mismatched == ["3.bias", "3.weight"]
    after = target.state_dict()
    assert torch.equal(after["0.weight"], source["0.weight"]) and torch.equal(after["0.bias"], source["0.bias"])
    assert torch.equal(after["3.weight"], before["3.weight"])  # reshaped head keeps its fresh init
    assert report.summary() == (
        "loaded 2 of the model's 4 keys; skipped 2 keys of the file (0 by load_ignore_keys, 0 not in the model, "
        "2 of another shape); 2 model keys keep their initialization (0 of them missing from the file)"
    )


@pytest.mark.parametrize("pattern", ["3.*", "state/model/3.*"], ids=["glob", "composer path"])
def test_ignore_keys_drop_a_new_head_so_a_strict_load_passes(pattern, source):
    target = model(num_classes=5, seed=3)
    head = target.state_dict()["3.weight"].clone()
    report = load_into(target, source, ignore_keys=[pattern])

    assert report.ignored == ["3.bias", "3.weight"] and report.missing == [] and report.ok
    assert torch.equal(target.state_dict()["0.weight"], source["0.weight"])
    assert torch.equal(target.state_dict()["3.weight"], head)

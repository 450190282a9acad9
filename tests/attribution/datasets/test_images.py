"""hookscope-cam reads images as they are meant to be seen, names unreadable files, and keeps file names exact."""

from __future__ import annotations

import csv
import io
import json
import warnings

import numpy as np
from PIL import Image

from attribution import open_results
from attribution.cli import main
from attribution.datasets.cli import read_rgb
from tests.attribution.datasets.test_processes import CLI_OPTIONS, make_checkpoint


def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 257 * 10], [257 * 128, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as raw:
        assert raw.mode.startswith("I")  # what PIL gives: 16-bit values, that convert("RGB") clips to 255
    rgb = np.asarray(read_rgb(tmp_path / "deep.png"))
    assert rgb.shape == (2, 2, 3) and rgb[..., 0].tolist() == [[0, 10], [128, 255]]


def test_exif_orientation_is_applied(tmp_path):
    pixels = np.zeros((4, 6, 3), dtype=np.uint8)
    pixels[0, 0] = 255  # a white top-left corner on a 4 x 6 (height x width) image
    exif = Image.Exif()
    exif[0x0112] = 6  # stored as shot: to be rotated 90 degrees clockwise to be seen
    Image.fromarray(pixels).save(tmp_path / "photo.png", exif=exif)
    seen = np.asarray(read_rgb(tmp_path / "photo.png"))
    assert seen.shape == (6, 4, 3)  # width and height swapped
    assert seen[0, -1].tolist() == [255, 255, 255]  # the corner is now top-right


def test_palette_greyscale_and_alpha_become_rgb_over_white(tmp_path):
    palette = Image.new("P", (2, 1))
    palette.putpalette([255, 0, 0, 0, 0, 255])
    palette.putpixel((0, 0), 0)
    palette.putpixel((1, 0), 1)
    palette.save(tmp_path / "p.png", transparency=1)  # index 1 (blue) is transparent
    assert np.asarray(read_rgb(tmp_path / "p.png")).tolist() == [[[255, 0, 0], [255, 255, 255]]]
    Image.fromarray(np.array([[[0, 0], [0, 255]]], dtype=np.uint8), mode="LA").save(tmp_path / "la.png")
    assert np.asarray(read_rgb(tmp_path / "la.png")).tolist() == [[[255, 255, 255], [0, 0, 0]]]
    Image.fromarray(np.array([[7, 200]], dtype=np.uint8)).save(tmp_path / "l.png")
    assert np.asarray(read_rgb(tmp_path / "l.png")).tolist() == [[[7, 7, 7], [200, 200, 200]]]


def test_unreadable_images_are_named_skipped_and_listed_and_names_kept_exact(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    names = ["ok.png", "line\nbreak é 漢.png", "truncated.jpg", "text.png"]
    for name in names[:3]:
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(images / name)
    (images / "truncated.jpg").write_bytes((images / "truncated.jpg").read_bytes()[:200])
    (images / "text.png").write_text("not an image")
    out = tmp_path / "out"
    args = [str(images), str(out), *CLI_OPTIONS, "--checkpoint", str(make_checkpoint(tmp_path / "c.pt")), "--quiet"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(args) == 0
    skipped = [str(w.message) for w in caught if str(w.message).startswith("skipped")]
    assert any("text.png" in m for m in skipped) and any("truncated.jpg" in m for m in skipped)
    files = json.loads((out / "files.json").read_text(encoding="utf-8"))
    assert sorted(files) == sorted(names)
    res = open_results(out)
    broken = {files.index("truncated.jpg"), files.index("text.png")}
    assert set(res.failures) == broken and all(res.maps[i].isnan().all() for i in broken)
    rows = list(csv.reader(io.StringIO((out / "summary.csv").read_text(encoding="utf-8"), newline="")))
    assert rows[0][-1] == "failure" and [row[1] for row in rows[1:]] == files  # the newline name kept exact
    assert {int(row[0]) for row in rows[1:] if row[-1]} == broken
    overlays = sorted(p.relative_to(out / "overlays").as_posix() for p in (out / "overlays").rglob("*.png"))
    assert overlays == sorted(["ok.png", "line\nbreak é 漢.png"])

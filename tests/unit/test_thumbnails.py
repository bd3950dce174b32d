"""The thumbnails stage's pure parts: the storyboard plan, the WebVTT track, the poster choice."""

from __future__ import annotations

import re

import pytest

from processors.thumbnails import (BLANK_VARIANCE, GREY_H, GREY_W, Options, choose_poster, luma_variance,
                                   plan_storyboard, sprite_command, webvtt)
from tapeline.settings import Settings

CUE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) --> (\d\d):(\d\d):(\d\d)\.(\d{3})$")


def cues(text: str) -> list[tuple[float, float, tuple[int, int, int, int]]]:
    lines = text.split("\n")
    assert lines[0] == "WEBVTT" and lines[1] == ""
    found = []
    for i, line in enumerate(lines):
        match = CUE.match(line)
        if match:
            g = [int(x) for x in match.groups()]
            start = g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000
            end = g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000
            name, _, xywh = lines[i + 1].partition("#xywh=")
            assert name == "storyboard.jpg"
            found.append((start, end, tuple(int(v) for v in xywh.split(","))))
    return found


@pytest.mark.parametrize("duration", [0.4, 1.0, 2.0, 5.28, 59.9, 600.0, 7200.5])
def test_cues_cover_the_whole_duration_and_every_tile_lies_in_the_sprite(duration):
    board = plan_storyboard(duration, 1280, 720, Options())
    found = cues(webvtt(board))
    assert len(found) == board.count >= 1
    assert found[0][0] == 0.0 and found[-1][1] == pytest.approx(duration, abs=0.0005)
    for (_, end, _), (start, _, _) in zip(found, found[1:]):
        assert start == end  # back to back: no gap, no overlap
    width, height = board.sprite_size
    for start, end, (x, y, w, h) in found:
        assert end > start
        assert (w, h) == (board.tile_w, board.tile_h) and x + w <= width and y + h <= height and x >= 0 and y >= 0
    assert len({xywh for _, _, xywh in found}) == len(found)  # one tile per cue


def test_short_clips_get_one_tile_and_long_ones_a_wider_interval():
    assert plan_storyboard(0.4, 1280, 720, Options()).count == 1
    assert plan_storyboard(5.28, 1280, 720, Options()).count == 3  # 0, 2, 4 s
    long = plan_storyboard(7200.0, 1280, 720, Options())
    assert long.count == 100 and long.interval_s == 72.0 and (long.columns, long.rows) == (10, 10)


def test_tile_height_keeps_the_display_aspect_and_is_even():
    assert plan_storyboard(10, 1280, 720, Options()).tile_h == 90
    assert plan_storyboard(10, 720, 1280, Options()).tile_h == 284  # portrait
    assert plan_storyboard(10, 640, 480, Options(tile_width=100)).tile_h == 76


@pytest.mark.parametrize("duration", [0.0, -1.0, float("nan"), float("inf")])
def test_no_storyboard_without_a_duration(duration):
    with pytest.raises(ValueError):
        plan_storyboard(duration, 1280, 720, Options())


def test_the_poster_is_the_tile_with_the_highest_luma_variance_never_a_blank_one():
    black, flat = bytes(GREY_W * GREY_H), bytes([128]) * (GREY_W * GREY_H)
    stripes = bytes((0 if (i // 8) % 2 else 200) for i in range(GREY_W * GREY_H))
    faint = bytes((100 if i % 2 else 110) for i in range(GREY_W * GREY_H))
    assert luma_variance(black) == luma_variance(flat) == 0.0 < BLANK_VARIANCE
    assert luma_variance(stripes) == pytest.approx(100.0 ** 2)
    index, variance = choose_poster([black, faint, stripes, flat])
    assert (index, variance) == (2, pytest.approx(10000.0))
    assert choose_poster([black, faint])[0] == 1
    with pytest.raises(ValueError):
        choose_poster([])


def test_options_come_from_settings_with_defaults_and_are_checked():
    assert Options.of(Settings()) == Options()
    given = Settings(stage_options={"thumbnails": {"interval_s": 5, "tile_width": 120}})
    assert Options.of(given) == Options(interval_s=5.0, tile_width=120)
    with pytest.raises(ValueError):
        Options.of(Settings(stage_options={"thumbnails": {"interval": 5}}))
    with pytest.raises(ValueError):
        Options.of(Settings(stage_options={"thumbnails": {"interval_s": 0}}))


def test_one_ffmpeg_pass_makes_the_sprite_and_the_grey_tiles(tmp_path):
    board = plan_storyboard(5.28, 1280, 720, Options())
    command = sprite_command(tmp_path / "source", board, tmp_path / "s.jpg", tmp_path / "g.raw", 0)
    graph = command[command.index("-filter_complex") + 1]
    assert "fps=fps=0.500000:round=down:eof_action=pass" in graph and "tile=3x1" in graph
    assert command[command.index("-protocol_whitelist") + 1] == "file"
    assert command.count(str(tmp_path / "s.jpg")) == 1 and command[-1] == str(tmp_path / "g.raw")


def test_the_poster_is_cut_by_an_input_seek_or_by_decoding_through():
    from pathlib import Path

    from processors.thumbnails import poster_command

    fast = poster_command(Path("/s"), 2.0, Path("/p.jpg"), 1280, 0)
    slow = poster_command(Path("/s"), 2.0, Path("/p.jpg"), 1280, 0, decode_through=True)
    assert fast.index("-ss") < fast.index("-i") and slow.index("-ss") > slow.index("-i")
    assert fast[fast.index("-ss") + 1] == slow[slow.index("-ss") + 1] == "2.000"
    assert fast.count("-ss") == slow.count("-ss") == 1 and fast[-1] == slow[-1] == "/p.jpg"

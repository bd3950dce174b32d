"""Ladder planning from a probe: never upscale, even sizes, aspect kept, rotation honoured."""

import pytest

from processors.media import plan_ladder, _parse_progress
from schemas.models import SourceMedia

HEIGHTS = (1080, 720, 480, 360, 240)


def media(w, h, rotation=0):
    dw, dh = (h, w) if rotation in (90, 270) else (w, h)
    return SourceMedia(format_name="mov", duration_s=5.0, width=w, height=h, display_width=dw, display_height=dh,
                       rotation=rotation, fps=25.0, video_codec="h264")


def test_720p_source_gets_four_rungs_without_upscaling():
    ladder = plan_ladder(media(1280, 720), HEIGHTS)
    assert [(r.name, r.width, r.height) for r in ladder] == [
        ("720p", 1280, 720), ("480p", 854, 480), ("360p", 640, 360), ("240p", 426, 240)]


@pytest.mark.parametrize("w,h", [(640, 272), (1920, 1080), (1000, 1000), (176, 144), (3840, 2160)])
def test_every_rung_is_even_and_keeps_the_aspect_ratio(w, h):
    for rung in plan_ladder(media(w, h), HEIGHTS):
        assert rung.width % 2 == 0 and rung.height % 2 == 0
        assert rung.height <= h and rung.width <= w
        assert abs(rung.width / rung.height - w / h) < 0.02


def test_source_below_the_lowest_rung_gets_one_rendition_at_its_own_size():
    ladder = plan_ladder(media(176, 144), HEIGHTS)
    assert [(r.width, r.height) for r in ladder] == [(176, 144)]


def test_rotated_source_is_planned_upright():
    ladder = plan_ladder(media(1280, 720, rotation=90), HEIGHTS)  # a phone video: 720x1280 upright
    assert [(r.name, r.width, r.height) for r in ladder] == [
        ("1080p", 608, 1080), ("720p", 404, 720), ("480p", 270, 480), ("360p", 202, 360), ("240p", 136, 240)]


def test_progress_block_parsing_uses_microseconds():
    block = {"frame": "120", "out_time_us": "4842667", "out_time_ms": "4842667", "speed": "1.34x", "progress": "continue"}
    progress = _parse_progress(block)
    assert progress.frames == 120 and progress.out_time_s == pytest.approx(4.842667) and progress.speed == 1.34
    assert not progress.ended

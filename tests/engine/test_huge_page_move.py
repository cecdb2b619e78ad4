"""server/engine/setup.py's move of the weights onto 2 MiB pages: it waits for the engine's quiet moments."""

import logging
import sys
import threading
import time

import pytest
import torch

from model.huge_pages import frames_to_move
from server.engine.setup import move_to_huge_pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_the_server_moves_the_weights_only_while_its_engine_is_idle(caplog):
    """server/engine/setup.py's move: each frame waits for busy() to be false (moving beside running requests
    slowed them 2-3x), then goes on at full pace. (Its pages are not read from /proc/self/smaps here: that counts
    whole mappings, which other tests' engines share.)"""

    model = torch.nn.Linear(1024, 1536, bias=False)  # 6 MiB of weights: 3 or 4 frames
    frames = frames_to_move({(model.weight.data_ptr(), model.weight.nbytes)})
    assert len(frames) >= 3
    idle, polls = threading.Event(), []

    def busy() -> bool:
        polls.append(time.monotonic())
        return not idle.is_set()

    def moved() -> bool:
        return any("on 2 MiB pages" in r.message for r in caplog.records)

    with caplog.at_level(logging.INFO, logger="server.engine.setup"):
        move_to_huge_pages(model, busy)
        time.sleep(0.3)
        assert len(polls) > 10 and not moved()  # still waiting on its first frame
        idle.set()
        went_idle = time.monotonic()
        while not moved() and time.monotonic() < went_idle + 30:
            time.sleep(0.01)
        assert moved()
    # idle: every frame asked once and went on at once, where a busy engine holds each one a second
    assert time.monotonic() - went_idle < 0.9 * (len(frames) - 1)
    assert len([t for t in polls if t >= went_idle]) >= len(frames) - 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_under_a_load_without_pause_the_move_goes_on_a_frame_a_second(caplog):
    """Under a load without pauses each frame waits its second for a quiet moment, then moves."""
    model = torch.nn.Linear(1024, 1536, bias=False)
    frames = frames_to_move({(model.weight.data_ptr(), model.weight.nbytes)})
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="server.engine.setup"):
        move_to_huge_pages(model, busy=lambda: True)
        while (
            not any("on 2 MiB pages" in r.message for r in caplog.records) and time.monotonic() < start + 30
        ):
            time.sleep(0.05)
    assert any("on 2 MiB pages" in r.message for r in caplog.records)
    assert time.monotonic() - start >= 0.9 * len(frames)  # each frame waited its second for a quiet moment

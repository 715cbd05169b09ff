"""examples/train_elastic_mixed.py, the Ray recipe of elastic islands, on a real local cluster:
one actor per rank with max_restarts on two labelled islands, torchft's Lighthouse as a Ray
actor; island b's processes SIGKILLed mid-run, restarted by Ray, healed by torchft."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[test]')")

from examples import train_elastic_mixed as example  # noqa: E402


def test_an_island_killed_mid_run_comes_back_healed_and_no_step_is_lost():
    result = example.main(["--steps", "40", "--kill-at", "8", "--pause", "0.1"])
    events = " ".join(row["events"] for row in result["rows"])
    assert "b0, b1 killed" in events and "lost" in events and "rejoined" in events
    assert result["every_step"] and result["bit_equal"]
    assert result["recovery_s"] and max(result["recovery_s"]) < 10  # the survivors went on
    assert result["heal_steps"] is not None and result["heal_steps"] <= 5
    assert [row["members"] for row in result["rows"]][-1] == 4  # everyone back at the end

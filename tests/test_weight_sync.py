"""The weight-sync recipe (examples/weight_sync_mixed.py) end to end on a real local cluster:
every way delivers the trainer's exact weights to every rollout (the example checks each
sync bit for bit), and the border counters show what crossed: the broadcast once, the
point-to-point transport once per rollout."""

from __future__ import annotations

from examples import weight_sync_mixed


def test_every_way_delivers_the_trainers_weights_and_the_broadcast_crosses_once(capsys):
    rows = weight_sync_mixed.main(["--sizes", "256K", "--receivers", "2", "--steps", "1", "--compress", "off"])
    by_way = {row["way"]: row for row in rows}
    assert set(by_way) == set(weight_sync_mixed.WAYS)
    size = by_way["hetccl"]["bytes"]
    assert by_way["hetccl"]["border bytes"] == 2 * size      # one transfer per rollout
    assert by_way["hetccl broadcast"]["border bytes"] == size  # across to the rollouts' island once
    assert by_way["hetccl"]["wire bytes"] == 2 * size          # compression off: raw on the wire
    assert "vs gloo" in capsys.readouterr().out

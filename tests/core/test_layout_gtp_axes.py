"""Where the GTP-remat axes sit in each grid, worked by hand: the dense one right after ``tp``, the expert one right
after ``ep`` (Megatron-Core's placement; tests/megatron/test_megatron_parity.py compares every field with
Megatron-Core itself). Here without Megatron-Core installed, so a swapped anchor fails even where it is absent."""

from __future__ import annotations

from pgregistry.layout import ParallelLayout


def test_dense_gtp_follows_tp_and_expert_gtp_follows_ep() -> None:
    # Default order tp-cp-ep-dp-pp over 8 ranks, tp = expt_tp = 2, gtp_remat = ep = expt_gtp_remat = 2:
    # dense rank = tp + 2 * gtp_remat + 4 * dp; expert rank = expt_tp + 2 * ep + 4 * expt_gtp_remat.
    layout = ParallelLayout(num_ranks=8, tp=2, gtp_remat=2, ep=2, expt_gtp_remat=2)
    assert layout.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.groups("gtp_remat") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.groups("expt_tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.groups("ep") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.groups("expt_gtp_remat") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.coords(6) == {
        "tp": 0, "gtp_remat": 1, "cp": 0, "dp": 1, "pp": 0, "expt_tp": 0, "ep": 1, "expt_gtp_remat": 1, "expt_dp": 0,
    }

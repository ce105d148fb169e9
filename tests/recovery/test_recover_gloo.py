"""A rank SIGKILLed in the middle of a step: the survivors recover in-process and train on, exact on the smaller grid.

Each world trains a TP-sharded two-layer MLP in float64 with SGD + momentum (state that must carry over); a rank
kills itself after its backward, before the grads are synchronised. The ranks of its replicas leave with it; the
others recover, rebuild the smaller layout, carry their optimizer state over, redo the faulted step on the whole
global batch and go on. Every committed step, before and after the fault, must equal the unsharded float64 model
trained on the same global batches (the oracle, computed here): parameters, grad norm and zero count. So the
faulted step was applied exactly once, on the smaller grid, and the momentum survived. A world of 4 (TP 2 x DP 2)
checks that the commit keeps a survivor from stepping alone; worlds of 8 lose two replicas of TP 2 x DP 4 in a row
(leaking no communicator) and a rank of the MoE layout TP 2 x EP 4 (expert TP 1), whose expert replica spans two
dense ones, found by the check-ins; smaller worlds check each bad input is the same named error on every survivor,
that a rank lost inside ``recover`` after its check-in is lost like the first, and that only the committed steps of
the ranks that go on are compared.
Collective timeouts are short (the time a survivor stuck on a live peer takes to learn of the fault), and long
enough for 8 ranks on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from recovery_support import run_faulty_world

HIDDEN, FFN, OUT, BATCH, STEPS, LR, MOMENTUM = 4, 8, 3, 12, 4, 0.1, 0.9  # BATCH: divisible by DP 4, 3, 2, 1
TIMEOUT_S = 4.0  # collective timeout: a survivor stuck on a peer that already failed learns it after this long
WAIT_S = 6.0  # recovery's check-in window: longer than the collective timeout
TIMEOUT_8_S = 6.0  # 8 ranks on a loaded 2-core machine: a shorter timeout can expire on a live peer
WAIT_8_S = 9.0  # longer than the 8-rank timeout: a survivor blocked on a live peer checks in at that timeout


def _init() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(FFN, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(OUT, FFN, generator=g, dtype=torch.float64) / 3)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64)
    x[:, -1] = 0  # a dead input feature: its column of w1's grad is exactly zero, so the zero counts are not all 0
    return x, torch.randn(BATCH, OUT, generator=g, dtype=torch.float64)


def _oracle() -> list[tuple[float, int, torch.Tensor, torch.Tensor]]:
    """(grad norm, zero grad elements, w1, w2) after each step: the unsharded model, plain float64 SGD with
    momentum."""
    w1, w2 = (w.clone().requires_grad_() for w in _init())
    bufs: list[torch.Tensor | None] = [None, None]
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = ((torch.relu(x @ w1.T) @ w2.T - y) ** 2).sum(dim=1).mean()
        g1, g2 = torch.autograd.grad(loss, [w1, w2])
        norm = float(torch.sqrt((g1**2).sum() + (g2**2).sum()))
        zeros = int((g1 == 0).sum() + (g2 == 0).sum())
        with torch.no_grad():
            for i, (w, g) in enumerate(((w1, g1), (w2, g2))):
                bufs[i] = g.clone() if bufs[i] is None else MOMENTUM * bufs[i] + g  # type: ignore[operator]
                w -= LR * bufs[i]  # type: ignore[operator]
        out.append((norm, zeros, w1.detach().clone(), w2.detach().clone()))
    return out


def _train(
    rank: int, store: dist.Store, *, kills: dict[int, int], with_norm: bool = True, ep: int = 1,
    expt_tp: int = 2, told: bool = False, timeout: float = TIMEOUT_S, wait: float = WAIT_S,
) -> dict[str, Any]:
    """Train ``STEPS`` steps on TP 2 x DP (world / 2) (EP ``ep`` and expert TP ``expt_tp`` declared in the
    layout; the model itself is dense), recording with the norm each step's grad norm and zero count
    (:func:`pgregistry.count_zeros`); at step ``s`` of ``kills`` the rank that started as ``kills[s]`` kills
    itself after its backward. ``told``: it says so in the store first (as a health agent would), and the survivors
    pass it to ``recover`` as the lost rank (its old rank in the current world); otherwise they wait for the
    check-ins."""
    from torch import nn

    from pgregistry import build, build_optimizer, count_zeros
    from pgregistry.collection import group_rank, group_size
    from pgregistry.layout import ParallelLayout
    from pgregistry.params import mark_tensor_parallel
    from pgregistry.recovery import carry_optimizer_state, commit, recover

    pg = build(ParallelLayout(num_ranks=dist.get_world_size(), tp=2, ep=ep, expt_tp=expt_tp), name="job",
               timeout=timeout)
    groups_held = [len(dist.distributed_c10d._world.pg_map)]
    tp, tp_rank = group_size(pg.tp), group_rank(pg.tp)
    w1, w2 = _init()
    model = nn.Module()
    model.w1 = nn.Parameter(mark_tensor_parallel(w1.chunk(tp, 0)[tp_rank].clone(), 0))
    model.w2 = nn.Parameter(mark_tensor_parallel(w2.chunk(tp, 1)[tp_rank].clone(), 1))
    mark_tensor_parallel(model.w1, 0)
    mark_tensor_parallel(model.w2, 1)

    def make_optimizer(collection: Any) -> Any:
        return build_optimizer(model, collection, optimizer="sgd", lr=LR, momentum=MOMENTUM, mixed_precision=False)

    opt = make_optimizer(pg)
    history: dict[int, tuple[float | None, int | None, torch.Tensor, torch.Tensor]] = {}
    recoveries = []
    committed, step = -1, 0
    while step < STEPS:
        try:
            opt.zero_grad()
            x, y = _batch(step)
            rows = x.shape[0] // group_size(pg.dp)
            part = slice(group_rank(pg.dp) * rows, (group_rank(pg.dp) + 1) * rows)
            partial = torch.relu(x[part] @ model.w1.T) @ model.w2.T
            summed = partial.detach().clone()
            dist.all_reduce(summed, group=pg.tp)
            loss = ((partial + (summed - partial.detach()) - y[part]) ** 2).sum(dim=1).mean()
            loss.backward()
            if kills.get(step) == rank:
                store.set(f"test/dead/{step}", str(dist.get_rank()))
                os.kill(os.getpid(), signal.SIGKILL)
            opt.sync_grads()
            # Without the norm (a TP all-reduce after the sync) rank 0 could pass every collective of the step
            # while rank 1 failed: only the commit stops it from stepping alone.
            norm = float(opt.get_grad_norm()) if with_norm else None
            zeros = count_zeros(list(model.parameters()), pg) if with_norm else None
            commit(pg)
            opt.step()
        except RuntimeError as fault:  # torch's DistBackendError is one
            # Told only of a rank that said it dies: a spurious timeout (a loaded machine) then recovers with nothing
            # lost, and the assertions on the recoveries say so, instead of a wait for a word that never comes.
            key = f"test/dead/{step}"
            lost = [int(store.get(key))] if told and store.check([key]) else None
            recovered = recover(pg, store, committed_step=committed, lost=lost, wait=wait, timeout=timeout)
            pg = recovered.collection
            new_opt = make_optimizer(pg)
            carry_optimizer_state(opt, new_opt)
            opt = new_opt
            recoveries.append({
                "fault": type(fault).__name__, "generation": recovered.generation, "rank": recovered.rank,
                "lost": recovered.shrunk.lost, "leaving": recovered.shrunk.leaving, "dp": group_size(pg.dp),
                "ep": group_size(pg.ep), "expt_dp": group_size(pg.expt_dp), "world": dist.get_world_size(),
                "created": recovered.communicators_created, "keepable": recovered.communicators_keepable,
                "step": recovered.committed_step,
            })
            groups_held.append(len(dist.distributed_c10d._world.pg_map))
            step = recovered.committed_step + 1
            continue
        history[step] = (norm, zeros, model.w1.detach().clone(), model.w2.detach().clone())
        committed, step = step, step + 1
    return {"tp_rank": tp_rank, "history": history, "recoveries": recoveries, "groups_held": groups_held}


def test_a_rank_killed_before_the_grad_sync_lets_no_survivor_step_alone() -> None:
    # TP 2 x DP 2, rank 3 dies after its backward. Without a collective after the grad sync, rank 0 (whose DP peer,
    # rank 2, synced with it) would pass the step while rank 1 failed: only the commit keeps it from stepping
    # alone. The lost rank is told (no check-in window to wait for; the MoE test below finds it by the check-ins).
    results = run_faulty_world(
        4, lambda rank, store: _train(rank, store, kills={2: 3}, with_norm=False, told=True),
        collective_timeout=TIMEOUT_S, deadline=60.0,
    )
    assert results[3] == ("died", signal.SIGKILL)
    assert results[2][0] == "raised" and results[2][1][0] == "LeftWithReplica", results[2]
    oracle = _oracle()
    for rank in (0, 1):
        kind, got = results[rank]
        assert kind == "ok", _why(results[rank])
        (recovery,) = got["recoveries"]
        assert (recovery["lost"], recovery["leaving"], recovery["dp"], recovery["world"]) == ((3,), (2, 3), 1, 2)
        assert recovery["step"] == 1  # steps 0 and 1 committed; the faulted step 2 was discarded and redone
        _check_against_oracle(got, oracle)


def _why(outcome: tuple[str, Any]) -> str:
    """How a rank ended, its traceback in full when it raised."""
    kind, detail = outcome
    return f"{kind}: {detail[2]}" if kind == "raised" else f"{kind}: {detail!r}"[:2000]


def _check_against_oracle(
    got: dict[str, Any], oracle: list[tuple[float, int, torch.Tensor, torch.Tensor]]
) -> None:
    """Every step committed once, its parameters, grad norm and zero count those of the unsharded float64 model."""
    assert sorted(got["history"]) == list(range(STEPS))
    tp_rank = got["tp_rank"]
    for step, (norm, zeros, w1, w2) in got["history"].items():
        want_norm, want_zeros, want_w1, want_w2 = oracle[step]
        if norm is not None:
            assert norm == pytest.approx(want_norm, rel=1e-6), step  # the norm is returned in float32
            assert zeros == want_zeros > 0, step
        torch.testing.assert_close(w1, want_w1.chunk(2, 0)[tp_rank], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w2, want_w2.chunk(2, 1)[tp_rank], rtol=1e-12, atol=1e-12)


def test_two_losses_in_a_row_on_8_ranks_train_on_and_leak_no_communicator() -> None:
    # TP 2 x DP 4: rank 7 dies in step 1 (rank 6 leaves with it), then rank 3 in step 3 (rank 2 leaves): the
    # survivors, first ranks 0-5, then 0, 1, 4, 5, end on TP 2 x DP 2. The lost rank is told each time (the MoE
    # test finds it by the check-ins), so the world waits for no check-in window.
    results = run_faulty_world(
        8, lambda rank, store: _train(rank, store, kills={1: 7, 3: 3}, told=True, timeout=TIMEOUT_8_S, wait=WAIT_8_S),
        collective_timeout=TIMEOUT_8_S,
    )
    for rank in (3, 7):
        assert results[rank] == ("died", signal.SIGKILL), _why(results[rank])
    for rank in (2, 6):
        assert results[rank][0] == "raised" and results[rank][1][0] == "LeftWithReplica", results[rank]
    oracle = _oracle()
    for rank, new_ranks in {0: (0, 0), 1: (1, 1), 4: (4, 2), 5: (5, 3)}.items():
        kind, got = results[rank]
        assert kind == "ok", _why(results[rank])
        first, second = got["recoveries"]
        assert (first["lost"], first["leaving"], first["dp"], first["rank"]) == ((7,), (6, 7), 3, new_ranks[0])
        assert (second["lost"], second["leaving"], second["dp"], second["rank"]) == ((3,), (2, 3), 2, new_ranks[1])
        assert (first["generation"], second["generation"]) == (1, 2)
        assert (first["step"], second["step"]) == (0, 2)  # each faulted step discarded, then redone
        # Each world holds the same kinds of groups (TP, DP, the world, one of this rank alone): a communicator
        # of an earlier world left behind would show here.
        assert got["groups_held"][0] == got["groups_held"][1] == got["groups_held"][2], got["groups_held"]
        _check_against_oracle(got, oracle)


def test_a_loss_in_the_moe_layout_takes_its_expert_replica_and_the_dense_replicas_it_spans() -> None:
    # TP 2 x EP 4 with expert TP 1 on 8 ranks: dense replicas {0, 1} .. {6, 7}, expert replicas {0-3} and {4-7}
    # (each expert twice). Rank 7 dies, told to nobody: the survivors find it by the check-ins. Its expert replica
    # takes ranks 4-7 (dense replicas 2 and 3); ranks 0-3 go on as TP 2 x DP 2 with EP 4 over one expert replica.
    # (With expert TP 2, the default, one expert replica spans all 8 ranks: any loss leaves no copy, see
    # test_shrink.py.) A survivor stuck on a live peer learns of the fault at the collective timeout: the check-in
    # window is longer.
    results = run_faulty_world(
        8, lambda rank, store: _train(rank, store, kills={2: 7}, ep=4, expt_tp=1, timeout=TIMEOUT_8_S, wait=WAIT_8_S),
        collective_timeout=TIMEOUT_8_S,
    )
    assert results[7] == ("died", signal.SIGKILL), _why(results[7])
    for rank in (4, 5, 6):
        kind, (name, message, _) = results[rank]
        assert (kind, name) == ("raised", "LeftWithReplica"), results[rank]
        assert f"rank {rank} is alive but leaves: losing rank(s) [7] takes ranks [4, 5, 6, 7]" in message
    oracle = _oracle()
    for rank in range(4):
        kind, got = results[rank]
        assert kind == "ok", _why(results[rank])
        (recovery,) = got["recoveries"]
        assert (recovery["lost"], recovery["leaving"], recovery["dp"], recovery["world"]) == ((7,), (4, 5, 6, 7), 2, 4)
        assert (recovery["ep"], recovery["expt_dp"]) == (4, 1)
        assert (recovery["generation"], recovery["rank"], recovery["step"]) == (1, rank, 1)
        assert recovery["created"] >= 2 and recovery["keepable"] >= 1
        _check_against_oracle(got, oracle)



def _recover_told(rank: int, store: dist.Store, told: list[list[int]]) -> list[tuple[str, str]]:
    """Call recover once per entry of ``told`` (the lost ranks every rank is told), without a fault: how each ended
    (the exception's type and message, or the new rank and world size)."""
    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import recover

    pg = build(ParallelLayout(num_ranks=4, tp=2), name="job", timeout=TIMEOUT_S)
    out = []
    for lost in told:
        try:
            recovered = recover(pg, store, committed_step=0, lost=lost, wait=WAIT_S, timeout=TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the outcome is the result
            out.append((type(error).__name__, str(error)))
            continue
        check = torch.ones(1)
        dist.all_reduce(check)  # the re-formed world works
        out.append(("ok", f"rank {recovered.rank} of {dist.get_world_size()}, sum {float(check)}"))
        pg = recovered.collection
    return out


def test_bad_losses_raise_the_same_error_on_every_survivor() -> None:
    results = run_faulty_world(
        4, lambda rank, store: _recover_told(rank, store, [[7], [1, 3]]), collective_timeout=TIMEOUT_S
    )
    outcomes = {rank: outcome for rank, (kind, outcome) in results.items() if kind == "ok"}
    assert len(outcomes) == 4, results
    for rank in range(4):
        assert outcomes[rank][0] == ("ValueError", "lost rank(s) [7] are outside the world of 4 ranks (0-3)")
    for rank in (1, 3):
        name, message = outcomes[rank][1]
        assert name == "RuntimeError"
        assert message.startswith(f"rank {rank} called recover but is among the lost ranks [1, 3]")
    for rank in (0, 2):
        name, message = outcomes[rank][1]
        assert name == "ValueError"
        assert message.startswith("losing rank(s) 1, 3 leaves no copy of the model: their replicas (dense replica(s) "
                                  "dp=0, 1 of 2) cover every rank 0-3")


def test_a_told_loss_takes_its_replica_and_a_lost_rank_calling_recover_is_refused() -> None:
    results = run_faulty_world(4, lambda rank, store: _recover_told(rank, store, [[3]]), collective_timeout=TIMEOUT_S)
    outcomes = {rank: outcome[0] for rank, (kind, outcome) in results.items() if kind == "ok"}
    assert len(outcomes) == 4, results
    assert outcomes[0] == ("ok", "rank 0 of 2, sum 2.0") and outcomes[1] == ("ok", "rank 1 of 2, sum 2.0")
    assert outcomes[2][0] == "LeftWithReplica"
    assert outcomes[3] == (
        "RuntimeError", "rank 3 called recover but is among the lost ranks [3] it was given: a lost rank takes no "
        "part in the recovery; end this process",
    )


def _late(rank: int, store: dist.Store) -> tuple[str, str]:
    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import recover

    pg = build(ParallelLayout(num_ranks=2), name="job", timeout=TIMEOUT_S)
    if rank == 1:
        time.sleep(2.5)  # stuck elsewhere past the survivors' wait
    try:
        recovered = recover(pg, store, committed_step=0, wait=1.0, timeout=TIMEOUT_S)
    except RuntimeError as error:
        return type(error).__name__, str(error)
    return "ok", f"rank {recovered.rank} of {dist.get_world_size()}, lost {recovered.shrunk.lost}"


def test_a_rank_arriving_after_the_decision_is_lost_and_told_so() -> None:
    results = run_faulty_world(2, _late, collective_timeout=TIMEOUT_S)
    assert results[0] == ("ok", ("ok", "rank 0 of 1, lost (1,)"))
    kind, (name, message) = results[1]
    assert (kind, name) == ("ok", "RuntimeError")
    assert message.startswith("rank 1 called recover after the survivors [0] had decided without it")


def _second_failure(rank: int, store: dist.Store) -> tuple[str, str]:
    import threading

    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import recover

    pg = build(ParallelLayout(num_ranks=4, tp=2), name="job", timeout=TIMEOUT_S)

    def die_once_decided() -> None:  # rank 1 is lost after the survivors confirmed, before the world is re-formed
        while not store.check(["pgregistry/recovery/0/confirm/0/decision"]):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1:
        threading.Thread(target=die_once_decided, daemon=True).start()
    try:
        recover(pg, store, committed_step=0, lost=[3], wait=WAIT_S, timeout=TIMEOUT_S)
    except RuntimeError as error:
        return type(error).__name__, str(error)
    return "ok", "recovered"


def test_a_survivor_lost_while_the_world_is_re_formed_is_named_on_the_others() -> None:
    results = run_faulty_world(4, _second_failure, collective_timeout=TIMEOUT_S)
    assert results[1] == ("died", signal.SIGKILL), _why(results[1])
    assert results[2][1][0] == "LeftWithReplica"
    kind, (name, message) = results[0]
    assert (kind, name) == ("ok", "RuntimeError"), results[0]
    # Rank 0 fails while the default group is re-formed, or (rank 1 killed just after it joined) while the groups
    # are built on it.
    assert message.startswith("a second failure during recovery, after the survivors had confirmed who goes on: rank "
                              "0 (-> 0) failed while the "), message
    assert ("the default group of generation 1 was re-formed over old ranks [0, 1], so" in message
            or "were built on the re-formed world of generation 1, so" in message), message
    assert ("a rank that was to go on was lost (or stopped) after the decision. Recovery cannot go on from here: end "
            "every process and restart the job from the last checkpoint. The backend said: ") in message


def _told_apart(rank: int, store: dist.Store) -> tuple[str, str]:
    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import recover

    pg = build(ParallelLayout(num_ranks=4), name="job", timeout=TIMEOUT_S)
    lost = {0: [2], 1: [3], 2: [3], 3: [2]}[rank]
    try:
        recover(pg, store, committed_step=0, lost=lost, wait=WAIT_S, timeout=TIMEOUT_S)
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, str(error)
    return "ok", "recovered"


def test_survivors_told_different_lost_ranks_all_refuse() -> None:
    results = run_faulty_world(4, _told_apart, collective_timeout=TIMEOUT_S)
    outcomes = [outcome for kind, outcome in results.values() if kind == "ok"]
    assert len(outcomes) == 4, results
    refused = [message for name, message in outcomes if name == "ValueError"]
    # The decision takes the first three (or four) to check in; a fourth checking in after it is told it is lost.
    late = [message for name, message in outcomes if name == "RuntimeError"]
    assert len(refused) >= 3 and len(refused) + len(late) == 4, outcomes
    assert all(m.startswith("the survivors were told different lost ranks (rank ") for m in refused), refused
    assert all(m.endswith("give every survivor the same lost ranks") for m in refused), refused
    assert all("had decided without it" in m for m in late), late


def _recover_with_steps(rank: int, store: dist.Store, calls: list[dict[int, int]]) -> list[tuple[str, str]]:
    """TP 2 x DP 2, rank 0 told lost (rank 1 leaves with it): one ``recover`` per entry of ``calls``, each rank
    saying it committed the step the entry gives it. How each call ended on this rank."""
    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import recover

    pg = build(ParallelLayout(num_ranks=4, tp=2), name="job", timeout=TIMEOUT_S)
    out = []
    for steps in calls:
        try:
            recovered = recover(pg, store, committed_step=steps.get(rank, 0), lost=[0], wait=WAIT_S,
                                timeout=TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the outcome is the result
            out.append((type(error).__name__, str(error)))
            continue
        out.append(("ok", f"rank {recovered.rank} of {dist.get_world_size()}, step {recovered.committed_step}"))
    return out


def test_only_the_steps_of_the_ranks_that_go_on_are_compared() -> None:
    # Rank 0 is lost and its replica-mate rank 1 leaves with it: rank 1's committed step is no survivor's business
    # (it may have applied a step the others did not, as a rank dying inside the commit leaves it). First ranks 2
    # and 3, who go on, disagree (4 and 5): every checked-in rank raises naming those two, not rank 1. Then ranks 2
    # and 3 agree on 5 while rank 1 says 6: they go on from 5, and rank 1 leaves.
    calls = [{1: 6, 2: 5, 3: 4}, {1: 6, 2: 5, 3: 5}]
    results = run_faulty_world(4, lambda rank, store: _recover_with_steps(rank, store, calls),
                               collective_timeout=TIMEOUT_S)
    outcomes = {rank: outcome for rank, (kind, outcome) in results.items() if kind == "ok"}
    assert len(outcomes) == 4, results
    for rank in (1, 2, 3):
        assert outcomes[rank][0] == (
            "RuntimeError", "the survivors committed different steps (rank 2: 5; rank 3: 4): the fault hit inside the "
            "commit, so some applied a step others did not. Reload a checkpoint",
        ), (rank, outcomes[rank][0])
    assert outcomes[1][1][0] == "LeftWithReplica", outcomes[1][1]
    assert outcomes[2][1] == ("ok", "rank 0 of 2, step 5") and outcomes[3][1] == ("ok", "rank 1 of 2, step 5")
    for call in range(2):
        assert outcomes[0][call][1].startswith("rank 0 called recover but is among the lost ranks [0]")


class _StopsAfterCheckIn(dist.Store):
    """A store through which its rank stops inside ``recover`` once it has checked in (its record written and
    counted), before the survivors decide: killed (a second failure, named by the decision), or stuck for
    ``stuck_s`` seconds."""

    def __init__(self, store: dist.Store, stuck_s: float | None) -> None:
        super().__init__()
        self._store = store
        self._stuck_s = stuck_s

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        total = self._store.add(key, amount)
        if key.endswith("/0/count") and amount == 1:
            if self._stuck_s is None:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self._stuck_s)
        return total


SECOND_LOSSES = {"killed-told": (True, None), "killed-found-by-the-check-ins": (False, None), "stuck-told": (True, 4.0)}


def _second_loss_before_the_decision(rank: int, store: dist.Store, case: str) -> tuple[Any, ...]:
    from pgregistry import build
    from pgregistry.layout import ParallelLayout
    from pgregistry.recovery import recover

    told, stuck_s = SECOND_LOSSES[case]
    pg = build(ParallelLayout(num_ranks=4), name="job", timeout=TIMEOUT_S)
    if rank == 3:  # the first loss
        os.kill(os.getpid(), signal.SIGKILL)
    recovered = recover(pg, _StopsAfterCheckIn(store, stuck_s) if rank == 1 else store, committed_step=0,
                        lost=[3] if told else None, wait=2.0, timeout=TIMEOUT_S)
    check = torch.ones(1)
    dist.all_reduce(check)  # the re-formed world works
    return recovered.shrunk.lost, recovered.rank, dist.get_world_size(), float(check)


@pytest.mark.parametrize("case", list(SECOND_LOSSES))
def test_a_survivor_lost_after_its_check_in_is_lost_like_the_first(case: str) -> None:
    # DP 4: rank 3 is lost, then rank 1 stops inside recover after its check-in, before the decision (which names
    # it). The confirmation round finds it silent: ranks 0 and 2 go on as a world of 2, both losses named. Stuck
    # past the wait rather than killed, rank 1 learns, when it answers, that it is lost.
    results = run_faulty_world(4, lambda rank, store: _second_loss_before_the_decision(rank, store, case),
                               collective_timeout=TIMEOUT_S)
    assert results[3] == ("died", signal.SIGKILL), _why(results[3])
    if SECOND_LOSSES[case][1] is None:
        assert results[1] == ("died", signal.SIGKILL), _why(results[1])
    else:
        kind, (name, message, _) = results[1]
        assert (kind, name) == ("raised", "RuntimeError"), _why(results[1])
        assert message.startswith("rank 1 answered the survivors' confirmation after they had confirmed [0, 2] "
                                  "without it (generation 0): it is lost to them; end this process"), message
    assert results[0] == ("ok", ((1, 3), 0, 2, 2.0)), _why(results[0])
    assert results[2] == ("ok", ((1, 3), 1, 2, 2.0)), _why(results[2])

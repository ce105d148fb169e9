"""Pass/fail checks across a torchrun world: init, run, gather, one table on rank 0, tear down.

``pgregistry verify`` and ``scripts/gpu_check.py`` both run a list of checks on every rank of a real
backend and report them the same way: one line per check, failing ranks named, and a closing ``N
passed, M failed`` line; every rank returns the same exit code. Tear-down destroys the registry's
subgroups before the default group (a gloo group left alive at interpreter exit can abort the
process) and waits at a barrier first, so no rank leaves while a peer may still be exchanging with
it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch

__all__ = ["Check", "nccl_without_cuda", "report_checks", "run_checks"]

Check: TypeAlias = tuple[str, bool, str]
"""One check: its name, whether it passed, a detail (values seen) for the report."""


def run_checks(
    title: str,
    backend: str,
    checks: Callable[[torch.device], list[Check]],
    *,
    timeout: float = 120.0,
    json_path: str | None = None,
) -> int:
    """Run ``checks(device)`` on every rank of the torchrun world; returns the exit code.

    0 when every check passed on every rank, 1 when any failed, 2 outside torchrun, for ``nccl``
    where torch sees no GPU, for a ``json_path`` rank 0 cannot write (checked before the checks
    run), or when the checks raise ``ValueError`` (bad input: every rank raises alike).

    Rank 0 prints ``title`` and the table (and writes it as JSON to ``json_path``). NCCL ranks use
    the GPU of their ``LOCAL_RANK``.
    """
    import torch
    import torch.distributed as dist

    from pgregistry import registry

    command = title.split(":")[0]
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            f"{command}: error: run it under torchrun (RANK and WORLD_SIZE are not set)",
            file=sys.stderr,
        )
        return 2
    init: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout)}
    if backend == "nccl":
        problem = nccl_without_cuda()
        if problem is not None:
            print(f"{command}: error: {problem}", file=sys.stderr)
            return 2
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = init["device_id"] = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(**init)
    try:
        return report_checks(title, checks, device, json_path)
    finally:
        # Drop what still holds groups (optimizers in reference cycles) before destroying them.
        gc.collect()
        registry.destroy()
        dist.destroy_process_group()


def nccl_without_cuda() -> str | None:
    """Why ``--backend nccl`` cannot run here (torch sees no GPU), or ``None`` when it can.

    Said before any process group or CUDA call, whose own errors (``Torch not compiled with CUDA
    enabled``, a missing ``_cuda_setDevice``) name neither the option nor the fix."""
    import torch

    if torch.cuda.is_available():
        return None
    build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
    return (
        f"--backend nccl needs CUDA, and torch {torch.__version__} here has none ({build}); "
        "use --backend gloo"
    )


def report_checks(
    title: str,
    checks: Callable[[torch.device], list[Check]],
    device: torch.device,
    json_path: str | None = None,
) -> int:
    """:func:`run_checks` in a world already initialised; the exit code, the same on every rank.

    Check ``json_path`` (rank 0 writes it, so rank 0's view decides, told to every rank), run
    ``checks(device)``, gather, print (and write) the table on rank 0."""
    import torch.distributed as dist

    command = title.split(":")[0]
    try:
        problem = _unwritable_on_rank_zero(json_path)
        if problem is not None:
            raise ValueError(problem)
        mine = checks(device)
    except ValueError as exc:
        if dist.get_rank() == 0:
            print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        _print_report(title, everyone, json_path)
    dist.barrier()
    return 1 if any(not ok for rank_checks in everyone for _, ok, _ in rank_checks) else 0


def _unwritable_on_rank_zero(json_path: str | None) -> str | None:
    """Why rank 0 cannot write ``json_path``, told to every rank; None when it can or there is none.

    One broadcast, since the file is rank 0's, on rank 0's node."""
    import torch.distributed as dist

    from pgregistry.cli._options import check_output_file

    if json_path is None:
        return None
    problem: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            check_output_file(json_path)
        except ValueError as exc:
            problem = [str(exc)]
    dist.broadcast_object_list(problem, src=0)
    return problem[0]


def _print_report(title: str, everyone: list[list[Check]], json_path: str | None) -> None:
    rows = []
    for i, (name, _, _) in enumerate(everyone[0]):
        failing = [rank for rank, checks in enumerate(everyone) if not checks[i][1]]
        detail = everyone[failing[0] if failing else 0][i][2]
        rows.append(
            {"check": name, "passed": not failing, "failing_ranks": failing, "detail": detail}
        )
    print(f"{title}; {len(everyone)} ranks")
    for row in rows:
        where = f" on ranks {row['failing_ranks']}" if row["failing_ranks"] else ""
        detail = f" ({row['detail']})" if row["detail"] else ""
        print(f"  [{'PASS' if row['passed'] else 'FAIL'}] {row['check']}{where}{detail}")
    failed = sum(not row["passed"] for row in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")

"""Benchmark: what the per-tensor checksums cost a rank-file checkpoint, against ``torch.save`` of the same state.

One process, no torch.distributed (every axis off). A model-like state (``--mib`` MiB of float32 tensors over
``--tensors`` tensors of sizes spread over two orders of magnitude) is, in this one run:

- ``torch.save`` to a file in ``--dir`` and fsynced: the baseline, what any checkpoint pays;
- ``checksums (save)``: :func:`pgregistry.checkpoint._integrity.checksums_of` over the same state, the extra work
  :func:`~pgregistry.checkpoint.save_rank_files` does per save;
- ``save_rank_files``: the whole save (checksums, temporary file, fsync, rename);
- ``torch.load`` (memory-mapped) and a copy of every tensor into the model: the baseline of a load;
- ``checksums (load)``: the CRCs a load computes, over the tensors as memory-mapped from the saved file;
- ``load_rank_files``: the whole load (read, checks, checksums of the tensors loaded, copy into the model).

Columns: milliseconds (median of ``--repeat`` after ``--warmup``) and GB/s over the state's bytes. The targets
(informative: the whole save at most 25% slower than ``torch.save`` of the same bytes, and the checksums' share
of each) are printed at the end. The files stay in the page cache between runs, so the disk is faster here than
a cold read or a network file system, where the checksums' share is smaller. Each save goes to a fresh
directory, removed after it. Usage: ``python benchmarks/checkpoint.py [--mib 1024] [--dir /fast/disk]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import MiB, Target, fill_, finish, measure, tensor_sizes  # noqa: E402
from pgregistry import attach  # noqa: E402
from pgregistry.checkpoint import load_rank_files, save_rank_files  # noqa: E402
from pgregistry.checkpoint._integrity import checksums_of  # noqa: E402
from pgregistry.collection import FIELD_NAMES, ProcessGroupCollection  # noqa: E402

_SAVE_OVERHEAD = 0.25


def _model(mib: int, count: int) -> nn.Module:
    model = nn.Module()
    sizes = tensor_sizes(count, mib * MiB // 4)
    params = [nn.Parameter(torch.empty(size)) for size in sizes]
    fill_([p.data for p in params], seed=1, zeros=0.0)
    for index, param in enumerate(params):
        model.register_parameter(f"p{index}", param)
    attach(model, ProcessGroupCollection(**dict.fromkeys(FIELD_NAMES)))
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="state size in MiB (default 1024)")
    parser.add_argument("--tensors", type=int, default=500, help="number of tensors (default 500)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    model = _model(args.mib, args.tensors)
    state = {name: param.detach() for name, param in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="pgregistry-checkpoint-bench-", dir=args.dir))
    saved = root / "saved"
    save_rank_files(saved, model)
    baseline_file = root / "baseline.pt"
    torch.save(state, baseline_file)

    def torch_save() -> None:
        with open(root / "torch.pt", "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        (root / "torch.pt").unlink()

    def our_save() -> None:
        save_rank_files(root / "again", model)
        shutil.rmtree(root / "again")

    def torch_load() -> None:
        loaded = torch.load(baseline_file, mmap=True, weights_only=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(loaded[name])

    mapped = torch.load(saved / "rank-00000.pt", mmap=True, weights_only=True)["state"]
    results = {
        "torch.save + fsync (baseline)": measure(torch_save, cpu, args.warmup, args.repeat)[0],
        "checksums (save)": measure(lambda: checksums_of(state), cpu, args.warmup, args.repeat)[0],
        "save_rank_files": measure(our_save, cpu, args.warmup, args.repeat)[0],
        "torch.load mmap + copy (baseline)": measure(torch_load, cpu, args.warmup, args.repeat)[0],
        "checksums (load)": measure(lambda: checksums_of(mapped), cpu, args.warmup, args.repeat)[0],
        "load_rank_files": measure(lambda: load_rank_files(saved, model), cpu, args.warmup, args.repeat)[0],
    }
    shutil.rmtree(root)
    print(f"{len(state)} float32 tensors, {nbytes / MiB:.0f} MiB, written under {root.parent}")
    print(f"{'':36}{'ms':>10}{'GB/s':>8}")
    for name, ms in results.items():
        print(f"{name:36}{ms:10.1f}{nbytes / ms / 1e6:8.2f}")
    save = results["save_rank_files"] / results["torch.save + fsync (baseline)"] - 1
    targets: list[Target] = [
        (f"save_rank_files at most {_SAVE_OVERHEAD:.0%} slower than torch.save", save <= _SAVE_OVERHEAD,
         f"{save:+.1%}"),
        *(
            (f"checksums' share of {kind}_rank_files", True, f"{results[f'checksums ({kind})'] / whole:.1%}")
            for kind, whole in (("save", results["save_rank_files"]), ("load", results["load_rank_files"]))
        ),
    ]
    return finish("checkpoint checksums", targets, [])


if __name__ == "__main__":
    sys.exit(main())

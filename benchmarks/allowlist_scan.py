"""Benchmark: the allowlist scan of a tree the size of Megatron-LM's ``megatron/`` (about 600 files, 250k lines).

Generates a synthetic tree of realistic Python (licence headers, docstrings, classes, type hints, loops,
comprehensions, f-strings, try/except, and reads of ``parallel_state`` in every import form on about one file in
five) in a temporary directory, then times, in this one run:

- the baseline: a naive single-process scan, ``ast.parse`` then ``ast.walk`` of every file (what Megatron-LM's
  checker, pull request 6258, does), with the interpreter's default garbage collection;
- pgregistry's cold scan (no cache) on all cores and on one core, and its warm re-scan (every file cached);
- the ``pgregistry allowlist check`` command end to end, cold and warm, as a fresh interpreter (start-up and
  imports included).

Usage: ``python benchmarks/allowlist_scan.py [--files 600] [--lines 250000] [--repeat 5]``.
Each figure is the median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pgregistry._source.cache import ScanCache  # noqa: E402
from pgregistry._source.config import ScanConfig  # noqa: E402
from pgregistry._source.engine import ScanReport, default_jobs, scan_files  # noqa: E402
from pgregistry._source.files import discover_files  # noqa: E402

WORDS = (
    "tensor layer weight bias grad buffer bucket param shard chunk token expert router logits hidden state "
    "config model optimizer scheduler batch sequence attention query key value mask embedding rotary norm "
    "scale offset stride rank group world size dtype device stream event handle cache step loss"
).split()

ACCESSORS = (
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_data_parallel_group",
    "get_data_parallel_world_size",
    "get_context_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_tensor_parallel_group",
    "get_data_parallel_src_rank",
)

LICENSE = "# Copyright (c) 2025, Example Corporation. All rights reserved.\n#\n" + "".join(
    f"# {line}\n"
    for line in (
        "Licensed under the Apache License, Version 2.0 (the 'License');",
        "you may not use this file except in compliance with the License.",
        "You may obtain a copy of the License at",
        "",
        "    http://www.apache.org/licenses/LICENSE-2.0",
        "",
        "Unless required by applicable law or agreed to in writing, software",
        "distributed under the License is distributed on an 'AS IS' BASIS,",
        "WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.",
    )
)

# (import line, how a read is spelled given that import)
IMPORT_FORMS = (
    ("from megatron.core import parallel_state", "parallel_state.{a}()"),
    ("from megatron.core import parallel_state as mpu", "mpu.{a}()"),
    ("import megatron.core.parallel_state as ps", "ps.{a}()"),
    ("import megatron.core.parallel_state as pstate", "pstate.{a}()"),
    ("import megatron.core.parallel_state", "megatron.core.parallel_state.{a}()"),
    ("from ..core import parallel_state", "functools.partial(parallel_state.{a})"),
    ("from megatron.core import parallel_state", 'getattr(parallel_state, "{a}")()'),
)


class _Writer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lines: list[str] = []

    def name(self, parts: int = 2) -> str:
        return "_".join(self.rng.choice(WORDS) for _ in range(parts))

    def emit(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text if text else "")

    def docstring(self, indent: int) -> None:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(6, 14)))
        self.emit(indent, f'"""{words.capitalize()}.')
        if self.rng.random() < 0.6:
            self.emit(0, "")
            self.emit(indent, "Args:")
            for _ in range(self.rng.randint(1, 3)):
                self.emit(indent + 1, f"{self.name()}: the {self.rng.choice(WORDS)} to use.")
        self.emit(indent, '"""')

    def body(self, indent: int, read: str | None) -> None:
        a, b, c = self.name(), self.name(), self.name(1)
        self.emit(indent, f"{a} = self.{self.name()}.{self.name(1)}({b}, dim=-1)")
        if read is not None:
            self.emit(indent, f"{c}_group = {read}")
        kind = self.rng.randrange(5)
        if kind == 0:
            self.emit(indent, f"for index, item in enumerate({a}):")
            self.emit(indent + 1, f"if index % {self.rng.randint(2, 9)} == 0:")
            self.emit(indent + 2, f"item = item * {self.rng.random():.4f}  # rescale every few items")
            self.emit(indent + 1, f"{b}.append(item.{self.name(1)}())")
        elif kind == 1:
            self.emit(indent, "try:")
            self.emit(indent + 1, f"{c} = {{key: value for key, value in {a}.items() if value is not None}}")
            self.emit(indent, "except (KeyError, ValueError) as error:")
            self.emit(indent + 1, f'raise RuntimeError(f"{a}: cannot build {{{b}!r}}") from error')
        elif kind == 2:
            self.emit(indent, "with torch.no_grad():")
            self.emit(indent + 1, f"{c} = torch.cat([{a}, {b}], dim=0).contiguous()")
            self.emit(indent + 1, f"{c}.mul_(1.0 / max(1, len({b})))")
        elif kind == 3:
            self.emit(indent, f"if {a} is None or not {b}:")
            self.emit(indent + 1, "return None")
            self.emit(indent, f"{c} = sorted({b}, key=lambda x: (x.{self.name(1)}, -x.{self.name(1)}))")
        else:
            self.emit(indent, f"while {a} and len({b}) < {self.rng.randint(4, 64)}:")
            self.emit(indent + 1, f"{b} += [{a}.pop()]")
        self.emit(indent, f"return {a}")

    def function(self, indent: int, method: bool, read: str | None) -> None:
        if self.rng.random() < 0.2:
            self.emit(indent, self.rng.choice(("@property", "@torch.no_grad()", "@staticmethod", "@functools.cache")))
        args = ", ".join(f"{self.name()}: {self.rng.choice(('int', 'float', 'torch.Tensor', 'Optional[int]'))}"
                         for _ in range(self.rng.randint(0, 3)))
        first = "self, " if method else ""
        self.emit(indent, f"def {self.name()}({first}{args}) -> {self.rng.choice(('int', 'None', 'torch.Tensor'))}:")
        self.docstring(indent + 1)
        self.body(indent + 1, read)
        self.emit(0, "")

    def module(self, target_lines: int, form: tuple[str, str] | None) -> int:
        """Write one module of about ``target_lines`` lines; returns the number of reads planted."""
        self.emit(0, LICENSE.rstrip("\n"))
        self.emit(0, "")
        self.docstring(0)
        self.emit(0, "")
        for line in ("import functools", "import logging", "from typing import Optional", "", "import torch"):
            self.emit(0, line)
        if form is not None:
            self.emit(0, form[0])
        self.emit(0, "")
        self.emit(0, "logger = logging.getLogger(__name__)")
        self.emit(0, "")
        planted = 0
        while len(self.lines) < target_lines:
            read = None
            if form is not None and self.rng.random() < 0.3:
                read = form[1].format(a=self.rng.choice(ACCESSORS))
            if self.rng.random() < 0.7:
                self.emit(0, f"class {self.name().title().replace('_', '')}(torch.nn.Module):")
                self.docstring(1)
                self.emit(0, "")
                for _ in range(self.rng.randint(2, 8)):
                    self.function(1, True, read)
                    planted += read is not None
            else:
                self.function(0, False, read)
                planted += read is not None
            self.emit(0, "")
        return planted


def generate_tree(root: Path, files: int, lines: int, seed: int = 0) -> tuple[int, int]:
    """Write ``files`` modules totalling about ``lines`` lines under ``root``; returns (lines, reads)."""
    rng = random.Random(seed)
    # About a dozen files per directory, two levels deep, as in megatron/.
    directories = [root / "megatron" / f"pkg{i % 12:02d}" / f"sub{i // 12}" for i in range(max(1, files // 12))]
    packages = sorted({*directories, *(d.parent for d in directories), root / "megatron"})
    modules = files - len(packages)  # every package directory also holds an empty __init__.py
    weights = [rng.lognormvariate(0, 0.8) for _ in range(modules)]
    scale = lines / sum(weights)
    total_lines = reads = 0
    for index, weight in enumerate(weights):
        writer = _Writer(rng)
        form = rng.choice(IMPORT_FORMS) if rng.random() < 0.2 else None
        # A module overshoots its target by about half a class: aim that much lower.
        reads += writer.module(max(30, int(weight * scale) - 30), form)
        path = directories[index % len(directories)] / f"module_{index:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "\n".join(writer.lines) + "\n"
        path.write_text(text)
        total_lines += text.count("\n")
    for directory in packages:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "__init__.py").touch()
    return total_lines, reads


def naive_scan(root: Path) -> int:
    """The baseline: parse and fully walk every file in one process, as Megatron-LM's checker does."""
    count = 0
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_bytes(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("parallel_state", "mpu", "ps")
            ):
                count += 1
    return count


def median_time(run: Callable[[], object], repeat: int, before: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(repeat):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=600)
    parser.add_argument("--lines", type=int, default=250_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pgregistry-bench-") as temporary:
        root = Path(temporary)
        total_lines, reads = generate_tree(root, args.files, args.lines)
        (root / "pyproject.toml").write_text(
            '[tool.pgregistry.allowlist]\nroots = ["megatron"]\nallowlist = "allowlist.json"\n'
        )
        files = discover_files([root / "megatron"], root, ()).files
        size = sum(f.absolute.stat().st_size for f in files)
        config = ScanConfig()
        jobs = default_jobs()
        cache_dir = root / ".pgregistry_cache"

        def clear_cache() -> None:
            for entry in cache_dir.glob("*.json"):
                entry.unlink()

        def scan(processes: int, cache: ScanCache | None = None) -> ScanReport:
            """What the command does after start-up: discover the files, then scan them."""
            return scan_files(discover_files([root / "megatron"], root, ()).files, config, cache=cache, jobs=processes)

        found = sum(len(r.sites) for r in scan(jobs).results)
        baseline = median_time(lambda: naive_scan(root), args.repeat)
        parse_only = median_time(lambda: [ast.parse(f.absolute.read_bytes()) and None for f in files], args.repeat)
        cold = median_time(lambda: scan(jobs), args.repeat)
        cold_one = median_time(lambda: scan(1), args.repeat)
        scan(jobs, ScanCache(cache_dir, config))
        warm = median_time(lambda: scan(1, ScanCache(cache_dir, config)), args.repeat)
        command = [sys.executable, "-m", "pgregistry.allowlist"]
        environment = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run([*command, "update"], cwd=root, env=environment, check=True, capture_output=True)

        def cli(*extra: str) -> None:
            subprocess.run([*command, "check", *extra], cwd=root, env=environment, check=True, capture_output=True)

        cli_cold = median_time(lambda: cli(), args.repeat, before=clear_cache)
        cli_warm = median_time(lambda: cli(), args.repeat)
        cli_python = median_time(
            lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), args.repeat
        )

    print(f"tree: {len(files)} files, {total_lines:,} lines, {size / 1e6:.1f} MB; {reads} planted reads, "
          f"{found} sites found; {jobs} cores; median of {args.repeat}")
    rows = [
        ("baseline: naive ast.parse + ast.walk, 1 process", baseline),
        ("ast.parse only, 1 process (lower bound on 1 core)", parse_only),
        (f"pgregistry scan, cold (no cache), {jobs} processes", cold),
        ("pgregistry scan, cold (no cache), 1 process", cold_one),
        ("pgregistry scan, warm (all cached)", warm),
        ("`allowlist check` command, cold (incl. start-up)", cli_cold),
        ("`allowlist check` command, warm (incl. start-up)", cli_warm),
        ("(python -c pass, for scale)", cli_python),
    ]
    print(f"{'run':<52} {'seconds':>8} {'vs baseline':>12}")
    for label, seconds in rows:
        print(f"{label:<52} {seconds:>8.3f} {seconds / baseline:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the test suite as N parallel pytest processes on one GPU machine (device-tool calls are short and every fresh
machine starts with cold Triton caches: compiling is CPU work, so shards on 16 cores finish ~N times sooner).

    python tools/gpu_pytest.py --shards 6 --out $OUT/pytest [--gpus 2] [-- extra pytest args, e.g. -k normalize]

Tests are collected once and dealt round-robin, so every shard gets a share of each file. Each shard writes
``shard<i>.log`` (and its test ids, ``shard<i>.ids``), removed when the shard passes unless ``--keep-logs``: the device
tool returns a limited number of files from ``$OUT``, and a call that also runs a benchmark needs its results back;
the summary of every shard is printed. The exit status is nonzero when any shard fails, errors, times out or
collects nothing. Failures
are then run once more on their own (a host-timed test can fail only because the shards share the CPUs), and that
result is printed too. With ``--gpus N`` shard ``i`` sees GPU ``i % N`` only (``CUDA_VISIBLE_DEVICES``), so the tests
that need two GPUs skip there: run ``tests/test_multi_gpu.py`` on its own. Each shard's PyTorch CPU ops get
``cpu_count // N`` threads (``OMP_NUM_THREADS``), unless the caller's environment sets a count: on a 16-core H200
host, the 879 CPU-path tests took 20 s at 14 shards, where a thread per core in every shard had run past 10 minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def collect(extra: list[str]) -> list[str]:
    """Node ids of the selected tests (``pytest --collect-only -q``)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *extra],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True, help="folder for the shard logs")
    parser.add_argument("--only", type=int, default=None, help="run this shard only (a rerun of a failed one)")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds before unfinished shards are killed")
    parser.add_argument("--gpus", type=int, default=1, help="deal the shards over this many GPUs")
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs of shards that passed too")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (selection only)")
    args = parser.parse_args()

    ids = collect(args.pytest_args)
    if not ids:
        print("no tests collected")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    shards = [ids[i :: args.shards] for i in range(args.shards)]
    procs = []
    for i, shard in enumerate(shards):
        if not shard or args.only not in (None, i):
            continue
        listing = args.out / f"shard{i}.ids"
        listing.write_text("\n".join(shard) + "\n")
        log = open(args.out / f"shard{i}.log", "w")  # noqa: SIM115 (closed after the process ends)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shard]
        env = dict(os.environ)
        if args.gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(i % args.gpus)
        # The shards share the host's cores: each PyTorch CPU op spinning up a thread per core in every shard left
        # 15 shards of mostly CPU-path tests at two thirds of their tests after 300 s (run 62), so each shard gets
        # its share of the cores (unless the caller set a count).
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, str(max(1, (os.cpu_count() or 1) // len(shards))))
        procs.append((i, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    print(f"{len(ids)} tests in {len(procs)} shards")

    start = time.monotonic()
    worst = 0
    failed: list[str] = []
    for i, proc, log in procs:
        left = max(1.0, args.timeout - (time.monotonic() - start))
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = 124
        log.close()
        lines = (args.out / f"shard{i}.log").read_text().strip().splitlines()
        print(f"shard {i}: rc {rc} ({time.monotonic() - start:.0f} s) {lines[-1] if lines else ''}")
        for line in lines:  # the short summary's lines: the device tool may not return every log
            if line.startswith(("FAILED", "ERROR")):
                print("  " + line)
                # (a test id may hold spaces: "FAILED tests/x.py::t[a, b] - message")
                failed.append(line.split(" ", 1)[1].split(" - ", 1)[0])
        worst = max(worst, rc)
        if rc == 0 and not args.keep_logs:
            for name in (f"shard{i}.log", f"shard{i}.ids"):
                (args.out / name).unlink(missing_ok=True)
    if failed and worst == 1:
        # Tests that time the host (the CLI's two-minute budget) can fail only because the shards share the CPUs:
        # run the failures once more on their own and say so. The exit status still reports the first result.
        again = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *failed],
            capture_output=True,
            text=True,
            check=False,
        )
        print(f"rerun of the {len(failed)} failures alone: rc {again.returncode}")
        print("\n".join(again.stdout.strip().splitlines()[-40:]))
    return worst


if __name__ == "__main__":
    sys.exit(main())

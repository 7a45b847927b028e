"""Plants each defect of `defects.py` in a scratch copy of the repository and runs the tests
listed for it there: caught (a test failed), missed (all passed) or broken (collection or
import error, timeout; not counted as caught).

    python tests/mutations/plant.py [--only NAME ...] [--tier fast|slow|all] [--list]
                                    [--timeout S] [--json OUT]

The real checkout is never written to: each defect gets a fresh copy (tracked and untracked
non-ignored files) in a temporary directory, with ``PYTHONPATH=<copy>/src`` so that
``import optclip`` resolves there (checked before the tests run), not to the editable
install."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from defects import DEFECTS, Defect  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKERS = {"fast": None, "slow": "slow", "all": "slow or not slow"}
FAILED = re.compile(r"^FAILED (\S+)", re.MULTILINE)
ERROR = re.compile(r"^ERROR (\S+)", re.MULTILINE)


def repository_files() -> list[str]:
    """Tracked files and untracked files that git does not ignore, relative to `ROOT`."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    names = [n for n in out.decode().split("\0") if n]
    return [n for n in names if (ROOT / n).is_file() and not n.startswith("tests/mutations/")]


def copy_repository(files: list[str]) -> pathlib.Path:
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="optclip-mutant-"))
    for name in files:
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return scratch


def plant(scratch: pathlib.Path, defect: Defect) -> None:
    path = scratch / defect.path
    text = path.read_text()
    count = text.count(defect.old)
    if count != 1:
        raise ValueError(f"{defect.name}: `old` occurs {count} times in {defect.path}")
    mutated = text.replace(defect.old, defect.new)
    compile(mutated, str(path), "exec")  # (a mutant must still be valid Python)
    path.write_text(mutated)


def environment(scratch: pathlib.Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch / "src"), str(scratch / "tests")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_import(scratch: pathlib.Path, env: dict) -> str:
    """Where `import optclip` resolves in the scratch copy; raises if not to its `src/`."""
    out = subprocess.run(
        [sys.executable, "-c", "import optclip; print(optclip.__file__)"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    where = out.stdout.strip()
    if out.returncode != 0 or not where.startswith(str(scratch / "src")):
        raise RuntimeError(f"optclip resolves to {where!r}: {out.stderr[-2000:]}")
    return where


def pytest_command(tests, tier: str) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    command += ["-p", "no:randomly"] if _has_plugin("pytest_randomly") else []
    if MARKERS[tier] is not None:
        command += ["-m", MARKERS[tier]]
    return command + list(tests)


def _has_plugin(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def classify(code: int | None, output: str) -> tuple[str, str]:
    """``(result, first failing test)`` from pytest's exit code and output."""
    failed = FAILED.findall(output)
    errors = ERROR.findall(output)
    if code is None:
        return "broken (timeout)", ""
    if code == 1 and failed:
        return "caught", failed[0]
    if code == 0:
        return "missed", ""
    if code == 1 and errors:  # (a fixture or setup error: not a failed check)
        return "broken (error)", errors[0]
    return f"broken (exit {code})", (errors or [""])[0]


def run_one(defect: Defect, files: list[str], tier: str, timeout: float, keep: bool) -> dict:
    start = time.monotonic()
    scratch = copy_repository(files)
    row = {"defect": defect.name, "file": defect.path, "why": defect.why, "tier": tier}
    row["tests"] = list(defect.tests)
    try:
        plant(scratch, defect)
        env = environment(scratch)
        row["optclip_file"] = check_import(scratch, env)
        command = pytest_command(defect.tests, tier)
        row["command"] = " ".join(command[1:])
        try:
            done = subprocess.run(
                command,
                cwd=scratch,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            code, output = None, (e.stdout or b"").decode(errors="replace")
        row["exit_code"] = code
        row["result"], row["first_failure"] = classify(code, output)
        row["summary"] = (output.strip().splitlines() or [""])[-1][-300:]
    except Exception as e:  # noqa: BLE001 - a defect that cannot be planted is reported
        row.update(exit_code=None, result="broken (plant)", first_failure="", summary=str(e))
    finally:
        if keep:
            row["scratch"] = str(scratch)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| defect | file | why | tier | result | first failing test | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["defect"],
            r["file"].removeprefix("src/optclip/"),
            r["why"].replace("|", "\\|"),
            r["tier"],
            r["result"],
            f"`{r['first_failure']}`" if r["first_failure"] else "",
            f"{r['seconds']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    caught = sum(r["result"] == "caught" for r in rows)
    missed = sum(r["result"] == "missed" for r in rows)
    broken = len(rows) - caught - missed
    total = sum(r["seconds"] for r in rows)
    lines.append("")
    lines.append(
        f"{caught} caught, {missed} missed, {broken} broken of {len(rows)}; {total:.0f} s in all."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these defects only")
    parser.add_argument("--tier", choices=sorted(MARKERS), default="fast")
    parser.add_argument("--list", action="store_true", help="list the defects and exit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per defect")
    parser.add_argument("--json", metavar="OUT", help="write the rows to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    args = parser.parse_args(argv)
    chosen = DEFECTS
    if args.only:
        unknown = set(args.only) - {d.name for d in DEFECTS}
        if unknown:
            parser.error(f"unknown defects: {', '.join(sorted(unknown))}")
        chosen = [d for d in DEFECTS if d.name in args.only]
    if args.list:
        for d in chosen:
            print(f"{d.name:42} {d.path:34} {' '.join(d.tests)}")
        return 0
    files = repository_files()
    rows = []
    for defect in chosen:
        row = run_one(defect, files, args.tier, args.timeout, args.keep)
        print(f"{row['defect']}: {row['result']} {row['first_failure']} ({row['seconds']} s)")
        print(f"    {row['summary']}", flush=True)
        rows.append(row)
    print()
    print(markdown(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

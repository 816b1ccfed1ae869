"""Download size, installed size and install time of Tandem per extra, on this machine.

One wheelhouse with every CPU extra (packaging/wheelhouse.sh, ``[all]``) is made first;
then, for each set of extras, round after round with the order rotated, a fresh venv
gets ``pip install --no-index --find-links WHEELHOUSE "tandem[EXTRAS]"``. So the time is
what pip spends unpacking, installing and byte-compiling (no network: a download's time
depends on the link, its size is reported instead). Installed size is the venv's
site-packages less an empty venv's. The llama.cpp wheel is the one built for this CPU.

Run: ``python -m benchmarks.install_size --rounds 2`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
SETS = {"default": "", "+plots": "plots", "+onnx": "onnx", "+torch (CPU)": "torch", "all": "all"}


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def site_packages(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return site


def offline_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def install_once(wheelhouse: Path, extras: str, work: Path) -> dict:
    venv = work / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    empty = tree_bytes(site_packages(venv))
    report = work / "report.json"
    spec = f"tandem[{extras}]" if extras else "tandem"
    start = time.perf_counter()
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index",
                    "--find-links", str(wheelhouse), "--report", str(report), spec],
                   check=True, capture_output=True, env=offline_env())
    seconds = time.perf_counter() - start
    wheels = [Path(unquote(i["download_info"]["url"].removeprefix("file://")))
              for i in json.loads(report.read_text())["install"]]
    return {"seconds": seconds, "download": sum(w.stat().st_size for w in wheels),
            "installed": tree_bytes(site_packages(venv)) - empty, "packages": len(wheels)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-install-") as tmp:
        work = Path(tmp)
        wheelhouse = work / "wheelhouse"
        subprocess.run(["bash", str(ROOT / "packaging" / "wheelhouse.sh"), str(wheelhouse), "all"],
                       check=True, env=dict(os.environ, PYTHON=sys.executable), capture_output=True)
        names = list(SETS)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                runs[name].append(install_once(wheelhouse, SETS[name], work))
                print(f"round {r + 1} {name}: {runs[name][-1]['seconds']:.1f} s", file=sys.stderr)
    rows = []
    for name in names:
        times = [x["seconds"] for x in runs[name]]
        first = runs[name][0]
        rows.append({"set": name, "extras": SETS[name], "packages": first["packages"],
                     "download_mib": first["download"] / 2**20, "installed_mib": first["installed"] / 2**20,
                     "install_s_median": statistics.median(times), "install_s": times})
    print("| install | packages | download | installed | install time (median; runs) |")
    print("|---|---:|---:|---:|---|")
    for row in rows:
        spread = ", ".join(f"{t:.1f}" for t in row["install_s"])
        print(f"| {row['set']} | {row['packages']} | {row['download_mib']:.0f} MiB | {row['installed_mib']:.0f} MiB "
              f"| {row['install_s_median']:.1f} s ({spread}) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Helpers shared by the notebooks: find the built dtsim, run it, read its JSON/CSV outputs.

Notebooks never type numbers by hand: every figure comes from a dtsim run made here.
  DTSIM_BUILD    build folder (default: <repo>/build)
  DTSIM_FIGURES  where figures are written as PNG (default: <build>/notebook-figures)
"""
import io
import json
import os
import pathlib
import subprocess

import pandas as pd

REPO = pathlib.Path(__file__).resolve().parent.parent
BUILD = pathlib.Path(os.environ.get("DTSIM_BUILD", REPO / "build"))
FIGURES = pathlib.Path(os.environ.get("DTSIM_FIGURES", BUILD / "notebook-figures"))
FIGURES.mkdir(parents=True, exist_ok=True)


def _binary(name, sub):
    path = BUILD / sub / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build dtsim first (scripts/build.sh)")
    return str(path)


def dtsim(*args):
    """Runs dtsim with args; returns stdout (raises with stderr on failure)."""
    run = subprocess.run([_binary("dtsim", "sim/cli"), *map(str, args)], capture_output=True,
                         text=True)
    if run.returncode != 0:
        raise RuntimeError(f"dtsim {' '.join(map(str, args))}: {run.stderr.strip()}")
    return run.stdout


def dtsim_json(*args):
    return json.loads(dtsim(*args, "--json"))


def dtsim_csv(*args):
    return pd.read_csv(io.StringIO(dtsim(*args, "--csv")))


def dtexec(*args):
    """Runs dtexec with args; returns stdout (raises with stderr on failure)."""
    run = subprocess.run([_binary("dtexec", "exec/cli"), *map(str, args)], capture_output=True,
                         text=True)
    if run.returncode != 0:
        raise RuntimeError(f"dtexec {' '.join(map(str, args))}: {run.stderr.strip()}")
    return run.stdout


def mpirun_dtexec(ranks, *args):
    """Runs dtexec under mpirun with `ranks` processes (as root too, oversubscribing the cores)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ["mpirun", "-np", str(ranks), _binary("dtexec", "exec/cli"), *map(str, args)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"mpirun -np {ranks} dtexec {' '.join(map(str, args))}: "
                           f"{run.stderr.strip()}")
    return run.stdout


def validation_csv():
    run = subprocess.run([_binary("dtsim_validation", "bench"), "--csv"], capture_output=True,
                         text=True, check=True)
    return pd.read_csv(io.StringIO(run.stdout))


def save(fig, name):
    """Writes a figure as PNG under FIGURES and returns its path."""
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path

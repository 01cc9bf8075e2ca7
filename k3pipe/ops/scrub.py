"""Copies of text files with every secret k3pipe's scrubber knows blanked, for what leaves a machine.

The GPU kit's ``collect`` packs the node's logs into a record that travels (``scripts/gpu-node.sh``).
An engine writes its own log, not through k3pipe's logging: a vLLM prints its non-default arguments
(an ``hf_token`` resolved from ``{env.HF_TOKEN}`` among them), a process may echo its environment.
So each log is copied through :func:`scrub_file`, which blanks, as :mod:`k3pipe.core.secrets` does for
every record k3pipe writes itself:

- the values listed in a keys file (the node's made-up API keys, one a line);
- the secrets of the experiment that ran (``--experiment``): values under secret names, key-shaped
  strings, URL credentials, and the values of its ``{env.NAME}`` references where this process has
  them (:func:`k3pipe.experiment.load.register_experiment_secrets`);
- the values of this process's environment variables named like secrets (``*_API_KEY``,
  ``HF_TOKEN``, ``*_PASSWORD`` ...);
- whatever is shaped like a credential, registered or not (``sk-...``, ``hf_...``, an
  ``Authorization:`` header, ``user:password@`` in a URL).

``python -m k3pipe.ops.scrub [--keys FILE] [--experiment FILE] SRC DEST [SRC DEST ...]`` prints, per pair,
``SRC KEYS OTHERS``: how many of the keys file's keys it blanked (the record's leak count: k3pipe
must never let one out) and how many other secrets (an engine that echoed its arguments).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from k3pipe.core import secrets

__all__ = ["main", "register_known", "scrub_file"]


def register_known(keys_file: Path | None = None, experiment: Path | None = None) -> None:
    """Register with the scrubber every secret this process can know of (see the module's docstring).
    An experiment that cannot be read registers nothing more (its secrets are then in no log either:
    k3pipe refused it before it ran)."""
    if keys_file is not None and keys_file.is_file():
        secrets.register_all(line for line in keys_file.read_text().splitlines() if line.strip())
    if experiment is not None and experiment.is_file():
        from k3pipe.experiment.load import register_experiment_secrets

        try:
            data = yaml.safe_load(experiment.read_text(errors="replace"))
        except yaml.YAMLError:
            data = None
        if isinstance(data, dict):
            register_experiment_secrets(data)
    secrets.register_all(value for name, value in os.environ.items() if secrets.is_secret_name(name))


def scrub_file(src: Path, dest: Path, keys: list[str] | None = None) -> tuple[int, int]:
    """``src`` copied to ``dest`` with every known secret and credential-shaped string blanked;
    returns how many of ``keys`` it held (what k3pipe itself made up and must never let out: the
    record's leak count) and how many other secrets it blanked (an engine echoing its arguments).
    A text file; bytes that are not UTF-8 are kept as they are."""
    text = src.read_bytes().decode("utf-8", errors="surrogateescape")
    own = sum(text.count(k) for k in keys or [])
    clean = secrets.scrub(text)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(clean.encode("utf-8", errors="surrogateescape"))
    return own, max(0, clean.count(secrets.REDACTED) - text.count(secrets.REDACTED) - own)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3pipe.ops.scrub", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=Path, default=None, help="a file of keys to blank, one a line")
    p.add_argument("--experiment", type=Path, default=None, help="the experiment file that ran")
    p.add_argument("paths", nargs="+", type=Path, help="SRC DEST pairs")
    args = p.parse_args(argv)
    if len(args.paths) % 2:
        p.error(f"paths come in SRC DEST pairs; got {len(args.paths)} path(s)")
    register_known(args.keys, args.experiment)
    keys = [k for k in (args.keys.read_text().splitlines() if args.keys and args.keys.is_file() else []) if k]
    for src, dest in zip(args.paths[::2], args.paths[1::2], strict=True):
        own, others = scrub_file(src, dest, keys)
        sys.stdout.write(f"{src} {own} {others}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

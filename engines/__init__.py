"""The engines draftsmith samples with, one module each, holding its install, launch, configuration and quirks:

- `draftsmith`: our sampler, in this process (nothing to install);
- `transformers`: assisted generation, in this process (nothing to install);
- `vllm`: in a venv of its own (`draftsmith engines install vllm`); it samples training corpora
  (`data.generated.engine=vllm`) and is judged by `draftsmith deploy-check`;
- `llamacpp`: `llama-server`, built once (`draftsmith engines install llamacpp`); judged by `deploy-check`.

They live beside the trainer (not in deploy/) because training starts vLLM too; importing them loads no Lightning,
Hydra or W&B. `draftsmith engines` lists them with where each is installed.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from draftsmith.sampling.errors import DraftsmithError

# engine: (module, class); `installable` engines have an install() of their own
ENGINES = {"draftsmith": ("draftsmith", "DraftsmithEngine"), "transformers": ("transformers", "TransformersEngine"),
           "vllm": ("vllm", "VllmEngine"), "llamacpp": ("llamacpp", "LlamaCppEngine")}
INSTALLABLE = ("vllm", "llamacpp")


def module(name: str):
    """The engine's module (draftsmith.engines.NAME)."""
    if name not in ENGINES:
        raise DraftsmithError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    return import_module(f"draftsmith.engines.{ENGINES[name][0]}")


def open_engine(name: str, bundle, dtype: str = "fp32"):
    """The engine, opened on `bundle`; dtype reaches the in-process engines (vLLM and llama.cpp run in fp32 here, as
    the judge does). An engine that is not installed is refused in one line that says how to install it."""
    from draftsmith.engines.base import InProcess

    cls = getattr(module(name), ENGINES[name][1])
    return cls(bundle, dtype) if issubclass(cls, InProcess) else cls(bundle)


def status(name: str) -> str:
    """One line: where the engine is and whether it can run here."""
    if name not in INSTALLABLE:
        return "in this process, nothing to install"
    m = module(name)
    return m.missing() or f"installed ({m.python_path() if name == 'vllm' else m.home()})"


def main(argv=None, prog: str = "draftsmith engines") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="The engines draftsmith samples with and judges: list them, "
                                 "or install vLLM (its own venv) or llama.cpp (built once).",
                                 epilog="examples:\n  draftsmith engines\n  draftsmith engines install vllm\n"
                                        "  draftsmith engines install llamacpp",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", metavar="ACTION")
    sub.add_parser("list", help="each engine and whether it is installed (the default)")
    inst = sub.add_parser("install", help="install an engine: vllm or llamacpp")
    inst.add_argument("engine", choices=INSTALLABLE)
    inst.add_argument("--build", choices=["cuda", "cpu"], default=None,
                      help="vllm: its CUDA or CPU build (default: cuda where a CUDA device is present)")
    args = ap.parse_args(argv)
    try:
        if args.action == "install":
            if args.build and args.engine != "vllm":
                raise DraftsmithError(f"--build chooses vLLM's build; {args.engine} has one way to install")
            m = module(args.engine)
            m.install(args.build) if args.engine == "vllm" else m.install()
            return 0
        for name in ENGINES:
            print(f"{name:<13}{status(name)}")
        return 0
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

"""The ``kvbridge`` command: ``kvbridge eval ...`` and ``kvbridge demo ...``."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

COMMANDS = {
    "eval": "fit and evaluate an adapter (kept, agreement, R², TTFT ratio): real models with "
            "--source S --target T (short names, folders, GGUF files), else the testbed",
    "demo": "the end-to-end demo: real models with --real, else the testbed",
}


def _real_models(argv: Sequence[str], flag: str = "") -> bool:
    """Whether an eval names a model that is not a testbed model (or a demo asks for --real)."""
    if flag:
        return flag in argv
    import argparse

    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--source")
    pick.add_argument("--target")
    known, _ = pick.parse_known_args(argv)
    from kvbridge.experiments.testbed import MODEL_NAMES

    return any(n is not None and n not in MODEL_NAMES for n in (known.source, known.target))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        if args and args[0] not in ("-h", "--help"):
            print(f"kvbridge: unknown command {args[0]!r}", file=sys.stderr)
        width = max(map(len, COMMANDS))
        print("usage: kvbridge {" + ",".join(COMMANDS) + "} [options]\n")
        for name, text in COMMANDS.items():
            print(f"  {name:<{width}}  {text}")
        return 0 if args and args[0] in ("-h", "--help") else 2
    if args[0] == "eval" and _real_models(args[1:]):
        from kvbridge.experiments import real_eval as command
    elif args[0] == "eval":
        from kvbridge.experiments import eval as command
    elif _real_models(args[1:], "--real"):
        from kvbridge.experiments import real_demo as command
        args = [a for a in args if a != "--real"]
    else:
        from kvbridge.experiments import demo as command
    import kvbridge

    try:
        command.main(args[1:])
    except (kvbridge.Error, OSError) as e:  # bad files and arguments: a message, no traceback
        print(f"kvbridge {args[0]}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

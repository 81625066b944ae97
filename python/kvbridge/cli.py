"""The ``kvbridge`` command: ``kvbridge eval ...`` and ``kvbridge demo ...``."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

COMMANDS = {
    "eval": "fit and evaluate the testbed adapter (kept, agreement, R², TTFT ratio)",
    "demo": "the end-to-end demo on the testbed models through kvbridge.Bridge",
}


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
    if args[0] == "eval":
        from kvbridge import eval as command
    else:
        from kvbridge import demo as command
    import kvbridge

    try:
        command.main(args[1:])
    except (kvbridge.Error, OSError) as e:  # bad files and arguments: a message, no traceback
        print(f"kvbridge {args[0]}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

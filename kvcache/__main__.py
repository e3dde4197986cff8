"""`python -m kvcache` is the `kvcache` command."""
import signal
import sys


def main() -> int:
    """Run the `kvcache` command; a SIGHUP while `kvcache serve` starts does not end it."""
    if sys.argv[1:2] == ["serve"]:
        # SIGHUP asks the daemon to read its clients' keys again (which its start does anyway); its default action
        # ends the process, and the imports below take a while before `kvcache serve` installs its handler.
        signal.signal(signal.SIGHUP, lambda _signum, _frame: None)
    from kvcache.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())

"""`python -m kvcache` is the `kvcache` command."""
import sys

from kvcache.cli import main

sys.exit(main())

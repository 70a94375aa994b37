"""`python -m capt`: the same as the `capt` command."""

from .cli import main

raise SystemExit(main())

"""`python -m capt`: the same as the `capt` command."""

from .cli.main import main

raise SystemExit(main())

"""`python -m flashsim`: the same as the `flashsim` command."""

from .cli import main

raise SystemExit(main())

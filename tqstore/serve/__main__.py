"""`python -m tqstore.serve`: the same server as `tqstore serve`."""

from tqstore.serve.main import main

raise SystemExit(main())

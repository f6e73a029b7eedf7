"""`python -m sharing.cli`: the `vgpu` command."""

import sys

from sharing.cli.main import main

sys.exit(main())

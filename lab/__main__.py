"""`python -m k8s_dispatch.lab chaos|realcluster ...`"""

import sys

from k8s_dispatch.lab.cli import main

sys.exit(main())
